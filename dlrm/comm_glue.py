"""TEMPORARY: stock sharders until dlrm.comm lands."""
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder


def sharders(cfg):
    return [EmbeddingBagCollectionSharder()]


def stats(model, prefix=""):
    return {}


def summary(model):
    return {"forward_ratio": 1.0, "backward_ratio": 1.0, "max_abs_error_seen": 0.0}
