#!/usr/bin/env bash
# Sweep error-bound policy x bound (x codec, x seed): one `torchrun -m dlrm.train` per point, each
# in its own run directory (TensorBoard run + metrics.json), then the accuracy-vs-ratio summary.
#
#   scripts/sweep.sh [--out DIR] [--nproc N] [--dry-run] [HYDRA_OVERRIDE ...]
#
# Overrides use Hydra's multirun syntax (`policy=fixed,dual`, `policy.forward.scale=range(1,4)`,
# `seed=0,1`) and are expanded by Hydra's own parser into the Cartesian product; point k runs in
# DIR/<k>-<overrides> (Hydra's sweep subdir naming). An override replaces the default axis of
# the same key; any other is added to every point. Defaults: the bundled Criteo sample,
#   compression=lossy policy=fixed,dual policy.forward.scale=1,2,4 seed=0,1
# SWEEP_TRAIN replaces the entry point (default "-m dlrm.train"; any script taking its overrides).
# Points whose metrics.json exists are skipped, so re-running with the same --out continues a
# sweep. A failed point is reported and the others still run (exit status 1 at the end).
#
# Why not `torchrun -m dlrm.train -m ...` (Hydra's multirun inside torchrun)? Every rank would
# run the jobs one after another in the same processes, re-creating the process group per job on
# torchrun's store (the trainer's per-attempt store prefix is reused, so job 2 meets job 1's
# keys), each rank resolving its own ${now:} sweep dir, and one failed job ending the sweep.
# Tried: `torchrun --nproc_per_node 2 -m dlrm.train -m seed=0,1 max_iterations=3` finished job 0
# in about a second, then hung in job 1's process-group setup (killed after 100 s). One torchrun
# per point gives each point fresh processes and port, and isolates failures.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY="$(command -v python3)"
NPROC=2
OUT=""
DRY=0
ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --out=*) OUT="${1#--out=}"; shift ;;
    --nproc) NPROC="$2"; shift 2 ;;
    --nproc=*) NPROC="${1#--nproc=}"; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,25p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
OUT="${OUT:-$ROOT/multirun/sweep-$(date +%Y-%m-%d_%H-%M-%S)}"
DEFAULTS=("compression=lossy" "policy=fixed,dual" "policy.forward.scale=1,2,4" "seed=0,1")

# Expand with Hydra's override grammar (what its BasicSweeper does): one line per point,
# "<subdir>\t<override>\t<override>...".
POINTS="$(cd "$ROOT" && "$PY" - "${#DEFAULTS[@]}" "${DEFAULTS[@]}" "${ARGS[@]+"${ARGS[@]}"}" <<'EOF'
import itertools, re, sys
from hydra.core.override_parser.overrides_parser import OverridesParser

n = int(sys.argv[1])
defaults, given = sys.argv[2:2 + n], sys.argv[2 + n:]
parser = OverridesParser.create()
parsed = []
for text in defaults + given:
    try:
        parsed += parser.parse_overrides([text])
    except Exception as e:  # Hydra's grammar error, with the override it is about
        sys.exit(f"sweep.sh: bad override {text!r}: {e}")
axes = {}
for o in parsed:  # a given override replaces the default axis of the same key (`+key=` too)
    key = o.get_key_element()
    values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
    axes[key.lstrip("+~")] = [f"{key}={v}" for v in values]
for num, point in enumerate(itertools.product(*axes.values())):
    name = ",".join(sorted(p.lstrip("+~") for p in point))
    name = re.sub(r"[^A-Za-z0-9._=,+-]", "_", name)[:200]
    print("\t".join([f"{num}-{name}", *point]))
EOF
)"
COUNT="$(printf '%s\n' "$POINTS" | grep -c . || true)"
echo "sweep: $COUNT points -> $OUT"
[[ $DRY -eq 1 ]] || mkdir -p "$OUT"

failed=0
while IFS=$'\t' read -r -a FIELDS; do
  [[ ${#FIELDS[@]} -gt 0 ]] || continue
  sub="${FIELDS[0]}"
  overrides=("${FIELDS[@]:1}")
  dir="$OUT/$sub"
  # shellcheck disable=SC2206  # TRAIN is words on purpose: "-m dlrm.train" or "path/to/script.py"
  cmd=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" ${SWEEP_TRAIN:--m dlrm.train}
       "${overrides[@]}" progress_bar=false "hydra.run.dir='$dir'")  # quoted: Hydra reads , and = in values
  if [[ $DRY -eq 1 ]]; then
    printf '%q ' "${cmd[@]}"; echo
    continue
  fi
  if [[ -f "$dir/metrics.json" ]]; then
    echo "[$sub] done already, skipped"
    continue
  fi
  mkdir -p "$dir"
  echo "[$sub] ${overrides[*]}"
  if (cd "$ROOT" && OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "${cmd[@]}") </dev/null >"$dir/torchrun.log" 2>&1 \
      && [[ -f "$dir/metrics.json" ]]; then
    grep -E "^(test AUC|forward ratio)" "$dir/torchrun.log" | sed "s/^/[$sub]   /" || true
  else
    failed=$((failed + 1))
    echo "[$sub] FAILED (see $dir/torchrun.log):" >&2
    tail -n 5 "$dir/torchrun.log" | sed "s/^/[$sub]   /" >&2
  fi
done <<<"$POINTS"
[[ $DRY -eq 1 ]] && exit 0

(cd "$ROOT" && "$PY" -m dlrm.bench.summary "$OUT") || failed=$((failed + 1))
echo "TensorBoard: tensorboard --logdir $OUT"
[[ $failed -eq 0 ]] || { echo "sweep: $failed failure(s)" >&2; exit 1; }
