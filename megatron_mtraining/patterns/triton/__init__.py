"""Triton kernels of the pattern side: the fused estimator scores (:mod:`.estimator`, MTraining §3.2)
and the CP=1 index conversion (:mod:`.convert`, §3.3).

The submodules are imported lazily by their callers (never at package import): ``triton.jit``
decides at decoration time whether a kernel runs compiled or in the CPU interpreter
(``TRITON_INTERPRET=1``).
"""
