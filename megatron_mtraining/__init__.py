"""MTraining: context-parallel dynamic sparse attention for Megatron-Core (arXiv 2510.18830).

Layers, each importing only the ones before it: :mod:`~megatron_mtraining.common`,
:mod:`~megatron_mtraining.layout`, :mod:`~megatron_mtraining.distributed` (base utilities) ->
:mod:`~megatron_mtraining.patterns` (estimator, index conversion) -> :mod:`~megatron_mtraining.ops`
(attention kernels and :func:`~megatron_mtraining.ops.backends.select_backend`) ->
:mod:`~megatron_mtraining.ring` (ring schedules) -> configuration -> :mod:`~megatron_mtraining.megatron`
(the only package importing ``megatron.core``) -> training.
"""

__version__ = "0.1.0"
