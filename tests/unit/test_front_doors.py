"""Argument-time rules of the two command-line front doors: ``examples/pretrain_gpt.py`` (its
``validate_args``, which reads the YAML config) and the Megatron-LM patch (the glue's
``mtraining_config_from_args``, and the patch's own parser check for lines 0.16 to 0.19).

A ``kernel_backend`` the run's device cannot run (``fa4`` or ``triton`` on a CPU run, ``sdpa`` at
CP > 1) is an error naming the config key before any model is built (before: a traceback at the
first forward). The device is simulated (``torch.cuda.is_available`` and ``TRITON_INTERPRET``).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_mtraining.megatron import megatron_lm
from megatron_mtraining.megatron.args import ArgumentValidationError, build_parser, validate_args

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cpu_run(monkeypatch):
    """A CPU machine without the Triton interpreter."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _config(tmp_path, backend: str, extra: str = "") -> str:
    path = tmp_path / f"{backend}.yaml"
    path.write_text(f"kernel_backend: {backend}\n{extra}")
    return str(path)


def _trainer(config: str, cp: int = 1, *flags: str, cuda=None):
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "256",
            "--train-iters", "1", "--lr", "0", "--context-parallel-size", str(cp), "--mtraining-config", config,
            *flags]
    return validate_args(build_parser().parse_args(argv), world_size=cp, check_files=False, cuda=cuda)


def _megatron_lm(config: str, cp: int = 1, **kw):
    base = dict(cp_attention="mtraining", mtraining_config=config, context_parallel_size=cp,
                hierarchical_context_parallel_sizes=None, seq_length=256, num_layers=2, hidden_size=64,
                num_attention_heads=4, kv_channels=None, bf16=False, fp16=False, reset_attention_mask=False,
                reset_position_ids=False, attention_dropout=0.0, create_attention_mask_in_dataloader=False,
                position_embedding_type="rope")
    base.update(kw)
    return megatron_lm.mtraining_config_from_args(SimpleNamespace(**base))


CASES = [("fa4", 1, "FlashAttention-4 needs a CUDA device"),
         ("triton", 1, "Triton does not run on cpu"),
         ("sdpa", 2, "runs dense attention at cp_size 1 only")]


@pytest.mark.parametrize("backend, cp, needle", CASES)
def test_trainer_refuses_a_kernel_backend_the_run_cannot_use(cpu_run, tmp_path, backend, cp, needle):
    with pytest.raises(ArgumentValidationError) as e:
        _trainer(_config(tmp_path, backend), cp)
    assert f"'kernel_backend' '{backend}' on this cpu run" in str(e.value) and needle in str(e.value)


@pytest.mark.parametrize("backend, cp, needle", CASES)
def test_megatron_lm_glue_refuses_a_kernel_backend_the_run_cannot_use(cpu_run, tmp_path, backend, cp, needle):
    with pytest.raises(ValueError) as e:
        _megatron_lm(_config(tmp_path, backend), cp)
    assert f"'kernel_backend' '{backend}' on this cpu run" in str(e.value) and needle in str(e.value)


def test_backends_the_run_can_use_pass(cpu_run, tmp_path, monkeypatch):
    # negative controls: auto and torch anywhere; sdpa at CP=1 (torch's SDPA runs on the CPU too);
    # triton on the CPU under the interpreter; fa4 and triton where CUDA is available
    for backend, cp in (("auto", 2), ("torch", 2), ("sdpa", 1)):
        assert _trainer(_config(tmp_path, backend), cp).mtraining.kernel_backend == backend
        assert _megatron_lm(_config(tmp_path, backend), cp).kernel_backend == backend
    from megatron_mtraining.plan import kernel_backend_problem

    cfg = _megatron_lm(_config(tmp_path, "torch"))
    args = SimpleNamespace(num_attention_heads=4, hidden_size=64, context_parallel_size=2, seq_length=256, bf16=True)
    assert kernel_backend_problem(args, cfg.__class__(kernel_backend="triton"), cuda=True) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from megatron_mtraining.common import triton_importable

    if triton_importable():
        assert kernel_backend_problem(args, cfg.__class__(kernel_backend="triton"), cuda=False) is None


def test_a_gpu_launch_checked_on_a_machine_without_a_gpu(cpu_run, tmp_path):
    """``validate_args(cuda=True)`` (the Slurm scripts' dry run of a GPU launch on a login node) takes
    Triton and FA4 as installed on the ranks' GPUs and still applies the rules that do not depend on
    them; ``cuda=False`` is the CPU run of the cases above (negative control)."""
    for backend in ("triton", "fa4"):
        ok = _trainer(_config(tmp_path, backend), 1, "--bf16", "--kv-channels", "64", cuda=True)
        assert ok.mtraining.kernel_backend == backend
        with pytest.raises(ArgumentValidationError, match=f"'kernel_backend' '{backend}' on this cpu run"):
            _trainer(_config(tmp_path, backend), 1, "--bf16", "--kv-channels", "64", cuda=False)
    with pytest.raises(ArgumentValidationError, match="head_dim 96 is not supported"):
        _trainer(_config(tmp_path, "triton"), 1, "--bf16", "--kv-channels", "96", cuda=True)
    # FA4's dtype and head_dim rules do not depend on the machine: checked without a GPU too
    with pytest.raises(ArgumentValidationError, match="FA4 is used for head_dim 64, 96 or 128, got 16"):
        _trainer(_config(tmp_path, "fa4"), 1, "--bf16", cuda=True)
    with pytest.raises(ArgumentValidationError, match="FA4 needs bf16 or fp16 inputs, got torch.float32"):
        _trainer(_config(tmp_path, "fa4"), 1, "--kv-channels", "64", cuda=True)
    with pytest.raises(ArgumentValidationError, match="runs dense attention at cp_size 1 only"):
        _trainer(_config(tmp_path, "sdpa"), 2, "--bf16", cuda=True)
