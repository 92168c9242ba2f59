#!/usr/bin/env bash
# Two emulated nodes on one machine (see docs/two_nodes.md and dlrm/bench/two_nodes.py).
#
#   sudo scripts/two_nodes.sh [--rate 1gbit] [--delay 0] [--nproc-per-node 2] [--report FILE] [-- hydra overrides]
#
# Builds two network namespaces joined by a veth pair (10.27.0.1 <-> 10.27.0.2, addresses that
# exist only inside them), shapes that link with tc, runs `torchrun --nnodes 2 --node_rank {0,1}`
# with the trainer in each, and exits with the worst node's exit code. Needs root and iproute2.
# The namespaces (and so the link) are removed on exit, also on failure or interruption; their
# names carry this script's pid, so that concurrent runs do not collide.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$REPO/.venv/bin/python}"
TAG="$$"

if [[ ! -x "$PY" ]]; then
    echo "two_nodes.sh: no Python at $PY (run 'make venv' first, or set PYTHON=...)" >&2
    exit 2
fi

# The driver deletes its namespaces itself; this also covers the driver being killed outright.
cleanup() {
    command -v ip >/dev/null 2>&1 || return 0
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
        if [[ "$ns" == "dlrm-2n-$TAG-node0" || "$ns" == "dlrm-2n-$TAG-node1" ]]; then
            for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
            ip netns del "$ns" 2>/dev/null || true
        fi
    done
}
child=""
on_signal() {
    # the driver runs in the background (so that this trap runs at once); it stops its nodes on TERM
    if [[ -n "$child" ]]; then kill -TERM "$child" 2>/dev/null || true; wait "$child" 2>/dev/null || true; fi
    exit 130
}
trap cleanup EXIT
trap on_signal INT TERM

cd "$REPO"
"$PY" -m dlrm.bench.two_nodes --tag "$TAG" "$@" &
child=$!
rc=0
wait "$child" || rc=$?
exit "$rc"
