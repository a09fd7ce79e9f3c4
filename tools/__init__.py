"""Command-line tools of megatron_mtraining: data preparation, checkpoint conversion, evaluation,
benchmarks and the load-imbalance model. Each runs as ``python tools/<name>.py`` or, from the
repository root, ``python -m tools.<name>``; their shared code lives in the package
(:mod:`megatron_mtraining.bench`, :mod:`megatron_mtraining.patterns.io`,
:mod:`megatron_mtraining.patterns.synthetic`, :mod:`megatron_mtraining.data`).
"""
