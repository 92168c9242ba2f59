"""The sweep summary's command line: ``python -m dlrm.bench.summary SWEEP_DIR [--out PREFIX]``.

The summary lives in :mod:`dlrm.telemetry.sweep_summary`: training runs write it through its
Hydra callback, and the trainer never imports this package.
"""

from __future__ import annotations

import sys

from dlrm.telemetry.sweep_summary import main

if __name__ == "__main__":
    sys.exit(main())
