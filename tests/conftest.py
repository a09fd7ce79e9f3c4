"""Test-session set-up shared by every test module.

Without a GPU, Triton kernels can only run in Triton's CPU interpreter, and the interpreter must
be switched on before anything imports ``triton`` (its ``@triton.jit`` decorators are resolved
at import time). Several modules import it indirectly (the sparse ring's GPU factory, the
imbalance tool's GPU mode), so the switch lives here, before any test module is collected.
"""
import os

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # torch is a hard dependency; this only guards odd environments
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
