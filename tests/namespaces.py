"""Whether network namespaces can be made here (root, iproute2); the two-node tests skip with the reason."""

from dlrm.bench import netns


def why_not(what: str) -> str | None:
    """None where ``what`` can run, else the reason (``netns.preflight``'s message)."""
    try:
        netns.preflight(what, "pytest")
    except netns.NetnsError as e:
        return str(e)
    return None
