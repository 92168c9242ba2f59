"""`compression` stands alone: importing it pulls in neither torchrec, dlrm, data, fbgemm nor triton."""

import subprocess
import sys
from pathlib import Path


def test_import_compression_loads_no_heavy_or_upward_dependency():
    code = ("import sys, compression; "
            "bad = [m for m in ('torchrec', 'dlrm', 'data', 'fbgemm_gpu', 'triton') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
