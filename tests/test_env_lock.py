"""The pinned environment: the lock files cover what setup.cfg asks for, and the check names every
package that departs from a lock."""

from __future__ import annotations

import configparser
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
LOCKS = sorted((ROOT / "requirements").glob("*.lock"))


def _env_lock():
    spec = importlib.util.spec_from_file_location("env_lock", ROOT / "scripts" / "env_lock.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


env_lock = _env_lock()


def _setup_cfg_requirements() -> list[Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    lines += [line for extra in ("test", "lint") for line in cfg["options.extras_require"][extra].splitlines()]
    return [Requirement(line) for line in lines if line.strip()]


def test_both_flavours_are_locked():
    assert [p.name for p in LOCKS] == ["cpu.lock", "cuda.lock"]


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: p.name)
def test_lock_pins_every_requirement_of_setup_cfg_within_its_range(lock):
    """A dependency added to setup.cfg without refreshing the locks would install nowhere (set-up
    installs the lock alone, --no-deps): caught here, naming it."""
    pins = env_lock.read_lock(lock)
    for req in _setup_cfg_requirements():
        name = env_lock.normalise(req.name)
        assert name in pins, f"{lock.name} does not pin {req.name} (setup.cfg asks for {req}): run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{lock.name} pins {name}=={pins[name]}, setup.cfg asks {req}"
        )


def test_the_flavours_differ_in_the_torch_build_and_fbgemm():
    cpu, cuda = (env_lock.read_lock(ROOT / "requirements" / f"{f}.lock") for f in ("cpu", "cuda"))
    assert cpu["torch"].endswith("+cpu") and "+" not in cuda["torch"]
    assert "fbgemm-gpu-cpu" in cpu and "fbgemm-gpu" not in cpu
    assert "fbgemm-gpu" in cuda and "fbgemm-gpu-cpu" not in cuda
    assert not [n for n in cpu if n.startswith("nvidia-")]  # no CUDA libraries on a CPU host


def test_differences_name_unpinned_missing_and_other_versions():
    have = {"numpy": "2.5.5", "six": "1.17.0", "torch": "2.13.0+cpu", "dlrm-compress": "0.1.0"}
    lock = {"numpy": "2.4.6", "torch": "2.13.0+cpu", "tqdm": "4.70.1"}
    out = "\n".join(env_lock.differences(lock, have))
    assert "six==1.17.0 is installed but not pinned" in out
    assert "tqdm==4.70.1 is pinned but not installed" in out
    assert "numpy is 2.5.5, the lock pins 2.4.6" in out
    assert "torch" not in out and "dlrm-compress" not in out  # equal, and the project itself
    assert env_lock.differences(lock | {"six": "1.17.0", "numpy": "2.5.5", "tqdm": "x"}, have | {"tqdm": "x"}) == []


def test_read_lock_names_the_file_and_line_of_a_loose_pin(tmp_path):
    bad = tmp_path / "x.lock"
    bad.write_text("# header\nnumpy==2.4.6\nscipy>=1.0\n")
    with pytest.raises(SystemExit, match=r"x\.lock:3: expected 'name==version', got 'scipy>=1.0'"):
        env_lock.read_lock(bad)


def test_check_of_this_environment_against_another_lock_fails_naming_packages(tmp_path):
    """The check CI runs, on the running interpreter: a lock that lacks one installed package and
    pins another of a version that is not installed."""
    have = env_lock.installed()
    name = "pytest"
    lock = {n: v for n, v in have.items() if n not in (name, env_lock.PROJECT)}
    lock["numpy"] = "0.0.1"
    path = tmp_path / "other.lock"
    path.write_text("".join(f"{n}=={v}\n" for n, v in lock.items()))
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "env_lock.py"), "check", str(path)], capture_output=True, text=True
    )
    assert run.returncode == 1
    assert f"{name}=={have[name]} is installed but not pinned by the lock" in run.stderr
    assert f"numpy is {have['numpy']}, the lock pins 0.0.1" in run.stderr
