"""The LM-head losses' choices and the checks of ``--lm-loss liger``, without importing torch or
megatron.core (the argument check and ``--help`` stay fast); the losses are in :mod:`.lm_loss`.

Public API::

    LM_LOSS_IMPLS                 # ("megatron", "liger"): the --lm-loss choices
    LIGER_MIN_VERSION             # the oldest Liger-Kernel accepted
    liger_problem(device=None)    # why the fused loss cannot run here, or None
    liger_device_problem(device)  # the device part alone
"""

from __future__ import annotations

from typing import Optional

__all__ = ["LM_LOSS_IMPLS", "LIGER_MIN_VERSION", "LIGER_HINT", "liger_problem", "liger_device_problem"]

#: ``--lm-loss`` choices.
LM_LOSS_IMPLS = ("megatron", "liger")

#: the oldest Liger-Kernel the fused loss accepts, the release tested here. Releases before 0.8.2 scale
#: every token's gradient by the first token's under per-token upstream gradients (``reduction="none"``).
LIGER_MIN_VERSION = "0.8.5"

LIGER_HINT = f"pip install 'liger-kernel>={LIGER_MIN_VERSION}' (or this package's [liger] extra)"


def _liger_version() -> Optional[str]:
    """The version of the distribution that provides ``liger_kernel`` (``liger-kernel`` or a nightly
    build under another name), or ``None`` without package metadata."""
    import importlib.metadata

    names = importlib.metadata.packages_distributions().get("liger_kernel") or ["liger-kernel"]
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def liger_problem(device=None, what: str = "--lm-loss liger") -> Optional[str]:
    """Why the fused LM-head loss (``what``) cannot run here, or ``None`` when it can: Liger-Kernel
    missing, without package metadata or older than :data:`LIGER_MIN_VERSION`, or (with ``device``, a
    ``torch.device`` or string) :func:`liger_device_problem`."""
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        return f"{what} needs Liger-Kernel, which is not installed: {LIGER_HINT}"
    from packaging.version import InvalidVersion, Version

    have = _liger_version()
    if have is None:
        return f"{what}: Liger-Kernel imports but has no package metadata to check its version: {LIGER_HINT}"
    try:
        old = Version(have) < Version(LIGER_MIN_VERSION)
    except InvalidVersion:
        old = True
    if old:
        return (f"{what} needs Liger-Kernel >= {LIGER_MIN_VERSION} (the release tested; those before 0.8.2 "
                f"scale every token's gradient by the first token's), found {have}: {LIGER_HINT}")
    return None if device is None else liger_device_problem(device, what)


def liger_device_problem(device, what: str = "--lm-loss liger") -> Optional[str]:
    """Why Liger-Kernel's Triton kernels cannot run on ``device``, or ``None`` (CUDA with Triton
    importable, or the CPU under ``TRITON_INTERPRET=1``). Imports torch."""
    from megatron_mtraining.common import triton_runs_on

    if not triton_runs_on(device):
        return (f"{what} runs Triton kernels, which cannot run on {device} here: it needs a CUDA device with "
                "Triton installed (on the CPU only under TRITON_INTERPRET=1, for tests)")
    return None
