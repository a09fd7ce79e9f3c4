"""A trap for host reads of device data (shared by tests/unit/test_host_syncs.py and
tests/kernels/test_triton_host_syncs.py).

On CUDA an op whose result the host needs (``.item()``, ``bool(t)``, ``int(t)``, ``.tolist()``,
``nonzero``, ``unique``, ``masked_select``, boolean-mask indexing, ``repeat_interleave`` of a tensor
without ``output_size``, ``bincount``, ``torch.equal``) waits for every kernel queued before it. On
the CPU these ops are cheap, so :class:`HostReadTrap` (a ``TorchDispatchMode`` plus patches of the
Python-level readers) raises :class:`HostRead` on each of them instead.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default, aten.equal.default,
          aten.bincount.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
          aten._unique.default}


class HostRead(AssertionError):
    pass


class HostReadTrap(TorchDispatchMode):
    """Raise :class:`HostRead` on every op that, on CUDA, makes the host wait for the device."""

    def __init__(self):
        super().__init__()
        self._saved = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS:
            raise HostRead(f"host read: {func}")
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
            idx = args[1]
            if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx):
                raise HostRead(f"host read: boolean-mask indexing ({func})")
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            raise HostRead("host read: repeat_interleave without output_size")
        return func(*args, **kwargs)

    def __enter__(self):
        def trap(name):
            def raiser(self, *a, **k):
                raise HostRead(f"host read: Tensor.{name}")
            return raiser
        for name in ("tolist", "numpy"):
            self._saved.append((name, getattr(torch.Tensor, name)))
            setattr(torch.Tensor, name, trap(name))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, fn in self._saved:
            setattr(torch.Tensor, name, fn)
        self._saved.clear()
        return super().__exit__(*exc)
