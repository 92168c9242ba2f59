import os
import sys
from pathlib import Path

# Tests import the repo's top-level packages without relying on the editable install.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# One thread per process: multi-rank tests share 2 cores, and oversubscription makes them crawl.
os.environ.setdefault("OMP_NUM_THREADS", "1")
