"""Synthetic vertical-slash patterns: see :mod:`megatron_mtraining.patterns.synthetic` (same objects)."""

from ...patterns.synthetic import BLOCK, PatternStats, vertical_slash_indices  # noqa: F401
