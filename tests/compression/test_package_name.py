"""The codec folder `compression/` installs and imports as `dlrm_compression`: Python 3.14's standard
library has a `compression` package (PEP 784), and both must import side by side."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ours_imports_beside_a_stdlib_compression_package_that_comes_first(tmp_path):
    # a stand-in for 3.14's stdlib package, ahead of the project on sys.path as the stdlib would be
    standin = tmp_path / "stdlib" / "compression"
    standin.mkdir(parents=True)
    (standin / "__init__.py").write_text("WHOSE = 'stdlib'\n")
    (standin / "zstd.py").write_text("def compress(b):\n    return b'zstd:' + b\n")
    code = textwrap.dedent(
        """
        import torch
        from compression import zstd
        import compression
        import dlrm_compression
        from dlrm_compression import get_codec
        assert compression.WHOSE == "stdlib" and zstd.compress(b"x") == b"zstd:x"
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
        codec = get_codec("lossy")
        y = codec.decode(codec.encode(x, 0.01))
        assert float((y - x).abs().max()) <= 0.01
        print(dlrm_compression.__name__, compression.__file__)
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "stdlib"), str(ROOT)]))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    name, stdlib_file = r.stdout.split()
    assert name == "dlrm_compression" and Path(stdlib_file).parent == standin


def test_the_project_never_imports_the_codec_by_the_stdlib_name():
    found = []
    for folder in ("dlrm", "compression", "data", "tests"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            if f == Path(__file__).resolve():  # its stand-in of the stdlib package is imported by name
                continue
            for n, line in enumerate(f.read_text().splitlines(), 1):
                words = line.split()
                if words[:2] in (["import", "compression"], ["from", "compression"]) or (
                    len(words) > 1 and words[0] in ("import", "from") and words[1].startswith("compression.")
                ):
                    found.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []


def test_setup_installs_every_package_folder_and_maps_the_codec_folder():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    mapping = dict(line.split("=", 1) for line in cfg["options"]["package_dir"].strip().splitlines() if "=" in line)
    assert {k.strip(): v.strip() for k, v in mapping.items()} == {"dlrm_compression": "compression"}
    folders = {
        ".".join(p.parent.relative_to(ROOT).parts) for d in ("dlrm", "data") for p in (ROOT / d).rglob("__init__.py")
    }
    assert listed == folders | {"dlrm_compression"}
