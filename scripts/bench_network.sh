#!/usr/bin/env bash
# End-to-end training speedup on an emulated network link (see dlrm/netbench.py and README).
#
#   sudo scripts/bench_network.sh [--rate 100mbit] [--repeats 2] [--iterations N] [-- hydra overrides]
#
# Trains with 2 ranks inside a private network namespace whose loopback is throttled with tc, once
# per compression config (none, fp16, qcomm_fp16, qcomm_int8, lossy) and repeat, and prints a
# table of speedups against `none`. Needs root and iproute2 (setup: `apt-get install iproute2`).
# Only 127.0.0.1 inside the namespace is used; the namespace is removed on exit, also on failure.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$REPO/.venv/bin/python}"
NETNS="dlrm-netbench-$$"

if [[ "$(id -u)" -ne 0 ]]; then
    echo "bench_network.sh needs root: it creates a network namespace (ip netns add) and throttles" >&2
    echo "its loopback with tc. Run it as root, e.g. sudo $0 $*" >&2
    exit 2
fi
for tool in ip tc; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "bench_network.sh: '$tool' not found; install iproute2 first (apt-get install iproute2)" >&2
        exit 2
    fi
done
if ! ip netns list >/dev/null 2>&1; then
    echo "bench_network.sh: 'ip netns' does not work here (no network namespaces?)" >&2
    exit 2
fi
if [[ ! -x "$PY" ]]; then
    echo "bench_network.sh: no Python at $PY (run 'make venv' first, or set PYTHON=...)" >&2
    exit 2
fi

# The driver deletes its namespace itself; this trap also covers the driver being killed outright.
cleanup() {
    if ip netns list 2>/dev/null | grep -qw "$NETNS"; then
        for pid in $(ip netns pids "$NETNS" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns del "$NETNS" 2>/dev/null || true
    fi
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT TERM

cd "$REPO"
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PY" -m dlrm.bench.netbench --netns "$NETNS" "$@"
