"""Criteo data: streaming TSV preprocessing (``data.preprocess``), the batch loader
(``data.loader``), the synthetic generator (``data.synthetic``) and the bundled real sample.

Nothing is imported here, so that preprocessing does not pull in torch/torchrec.
"""
