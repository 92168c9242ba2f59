"""What the dense optimizer did, read from runs' final checkpoints (docs/dense_gradients.md, "DCT and Adagrad").

    python -m dlrm.bench.dense_state RUN_DIR...

Per run, over the MLP weights and biases: the share of entries the optimizer ever moved (an
Adagrad accumulator above zero: an entry DCT never sent keeps 0), the median accumulator of the
moved ones, the root mean square over iterations of the L2 norm of the gradient the optimizer was
given (from the accumulators: under DCT, what it sent), and the L2 norm of DCT's final residuals
(all ranks).
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dlrm.trainer.checkpoint_format import read_state, step_order

MLP = ("dense_arch", "over_arch")


def final_step(run_dir: Path) -> Path:
    root = run_dir / "checkpoints"
    return root / (root / "latest").read_text().strip()


def load(step_dir: Path) -> dict[str, Any]:
    """A DCP checkpoint as one flat dict of whole tensors (every rank's shards), in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(step_dir), str(Path(tmp) / "state.pt"))
        state = torch.load(Path(tmp) / "state.pt", weights_only=False)
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}/")
        else:
            flat[prefix[:-1]] = node

    walk(state, "")
    return flat


def mlp_weights(flat: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k[len("model/") :]: v for k, v in flat.items() if k.startswith("model/") and any(m in k for m in MLP)}


def summary(run_dir: Path) -> dict[str, float]:
    step = final_step(run_dir)
    flat = load(step)
    weights = mlp_weights(flat)
    found = [flat[f"optimizer/state/{k}/sum"].flatten() for k in weights if f"optimizer/state/{k}/sum" in flat]
    out: dict[str, float] = {}
    if found:  # Adagrad's accumulators (SGD keeps none)
        sums = torch.cat(found)
        out.update(moved_share=float((sums > 0).double().mean()), median_accumulator=float(sums[sums > 0].median()))
        # the L2 norm of what the optimizer received per iteration, root mean square over the run
        out["rms_update_norm"] = float(sums.double().sum() / (step_order(step) or (1, 0))[0]) ** 0.5
    residual_sq = 0.0
    for rank in range(read_state(step, 0).train_state["world_size"]):
        dense = read_state(step, rank).parts.get("dense_comm", {})
        for kind in ("residuals", "owner_residuals"):  # the reduce-scatter's owners hold residuals too
            residual_sq += sum(float(r.double().norm() ** 2) for r in dense.get(kind, {}).values())
    out["residual_norm"] = residual_sq**0.5
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    a = p.parse_args(argv)
    print("| run | MLP entries moved | median Adagrad accumulator | RMS gradient norm given | residual norm |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for run in a.runs:
        s = summary(run)
        moved = (
            f"{s['moved_share']:.1%} | {s['median_accumulator']:.3g} | {s['rms_update_norm']:.3f}"
            if "moved_share" in s
            else "- | - | -"
        )
        print(f"| {run.name} | {moved} | {s['residual_norm']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
