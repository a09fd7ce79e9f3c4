"""The steady-state sparse path reads nothing back from the device (no host synchronisation).

On CUDA an op whose result the host needs (``.item()``, ``bool(t)``, ``int(t)``, ``.tolist()``,
``nonzero``, ``unique``, ``masked_select``, boolean-mask indexing, ``repeat_interleave`` of a tensor
without ``output_size``, ``bincount``, ``torch.equal``) waits for every kernel queued before it.
On the CPU these ops are cheap, so the test traps them instead: :class:`HostReadTrap` (a
``TorchDispatchMode`` plus patches of the Python-level readers) raises on each of them. The
vertical-slash estimator and the index conversion with static widths (the CUDA default) run under
it, and their result is checked against the same calls with data-dependent widths: the same
selected lines, the same token-level masks of every ring step. Negative control: the
data-dependent widths trip the trap. The Triton step kernel's plans are trapped the same way in
tests/kernels/test_triton_host_syncs.py. On a GPU (marker ``gpu``) the estimator, the conversion,
the Triton step kernel's forward and backward and the column phase's set-up run under
``torch.cuda.set_sync_debug_mode("error")``.
"""
from __future__ import annotations

import pytest
import torch

from megatron_mtraining.layout import Layout
from megatron_mtraining.ops.sparse_reference import SparseStepKernel
from megatron_mtraining.patterns.convert import convert_pattern, step_key_mask, without_columns
from megatron_mtraining.patterns.estimator import VerticalSlashConfig, estimate_vertical_slash
from tests.helpers.host_reads import HostRead, HostReadTrap
from tests.workers.vs_data import make_qkv

CFG = VerticalSlashConfig(recall=0.9, last_q=64, block_size=64, sink_tokens=16, local_blocks=1,
                          max_vertical=96, max_slash=6)


def _inputs(S=1024, hq=4, hkv=2, d=16, seed=0):
    q, k, v = make_qkv(1, S, hq, hkv, d, seed=seed)
    return q, k, v


def _masks(steps, s_local):
    return [step_key_mask(st, s_local, counts=True) for st in steps]


def test_trap_catches_the_readers():
    """The trap fires on each kind of host read (so the tests below can fail)."""
    t = torch.arange(6)
    for read in (lambda: t.max().item(), lambda: bool(t.any()), lambda: int(t.sum()), lambda: t.tolist(),
                 lambda: t.nonzero(), lambda: torch.unique(t), lambda: t[t > 2],
                 lambda: torch.repeat_interleave(t, t), lambda: torch.equal(t, t)):
        with pytest.raises(HostRead):
            with HostReadTrap():
                read()
    with HostReadTrap():                    # fixed-size device-side work passes
        torch.sort(t).values.cumsum(0).clamp(max=3).gather(0, t.flip(0))


def test_estimator_and_conversion_without_host_reads():
    q, k, _ = _inputs()
    layout = Layout("striped", 1, 64)
    with HostReadTrap():
        pat = estimate_vertical_slash(q, k, layout=layout, config=CFG, impl="torch", static_widths=True)
        steps = convert_pattern(pat, layout, 0, impl="torch", static_widths=True)
        kernel = SparseStepKernel([without_columns(st) for st in steps] + steps, 0.25)
    assert kernel.empty == [False, False]
    ref = estimate_vertical_slash(q, k, layout=layout, config=CFG, impl="torch", static_widths=False)
    ref_steps = convert_pattern(ref, layout, 0, impl="torch", static_widths=False)
    # static widths are the caps; the data-dependent ones the largest counts
    assert pat.slash.shape[-1] == CFG.max_slash and pat.vertical.shape[-1] == CFG.max_vertical
    assert ref.slash.shape[-1] <= CFG.max_slash and ref.vertical.shape[-1] <= CFG.max_vertical
    assert pat.same_selection(ref)
    assert torch.equal(pat.slash_count, ref.slash_count) and torch.equal(pat.vertical_count, ref.vertical_count)
    for a, b in zip(steps, ref_steps):
        assert torch.equal(a.block_count, b.block_count) and torch.equal(a.column_count, b.column_count)
        assert a.known_max is not None and not a.known_max.exact and b.known_max.exact
        assert a.known_max.block >= b.known_max.block and a.known_max.column >= b.known_max.column
    for a, b in zip(_masks(steps, 1024), _masks(ref_steps, 1024)):
        assert torch.equal(a, b)


def test_data_dependent_widths_trip_the_trap():
    """Negative control: the data-dependent widths read the counts back."""
    q, k, _ = _inputs(seed=1)
    layout = Layout("striped", 1, 64)
    with pytest.raises(HostRead):
        with HostReadTrap():
            estimate_vertical_slash(q, k, layout=layout, config=CFG, impl="torch", static_widths=False)
    pat = estimate_vertical_slash(q, k, layout=layout, config=CFG, impl="torch", static_widths=True)
    with pytest.raises(HostRead):
        with HostReadTrap():
            convert_pattern(pat, layout, 0, impl="torch", static_widths=False)


@pytest.mark.parametrize("kind,cp", [("striped", 2), ("striped", 4), ("zigzag", 2), ("contiguous", 4)])
def test_conversion_at_cp_without_host_reads(kind, cp):
    """Every rank's per-owner steps at cp > 1 (the conversion itself needs no collective): no host
    read with static widths, the same token masks as with the data-dependent widths; a contiguous
    layout's future owners have zero bounds (skipped without a device read)."""
    S = 1024
    q, k, _ = _inputs(S, seed=cp)
    pat = estimate_vertical_slash(q, k, layout=Layout("striped", 1, 64), config=CFG, impl="torch",
                                  static_widths=True)       # the global pattern (identical on every rank)
    layout = Layout(kind, cp, 64)
    for rank in range(cp):
        with HostReadTrap():
            steps = convert_pattern(pat, layout, rank, impl="torch", static_widths=True)
            empty = SparseStepKernel(steps, 0.25).empty
        ref = convert_pattern(pat, layout, rank, impl="torch", static_widths=False)
        for a, b in zip(_masks(steps, S // cp), _masks(ref, S // cp)):
            assert torch.equal(a, b)
        if kind == "contiguous":
            assert empty == [o > rank for o in range(cp)]


@pytest.mark.gpu
def test_estimator_conversion_and_step_kernel_have_no_sync_on_cuda():
    """CUDA (Triton scores and conversion, bf16): after a warm-up call (kernel compilation), the
    estimator, the conversion, the step kernel's forward (with its backward plans built on the side
    stream), its backward and the out-of-ring column phase's set-up run without a host
    synchronisation (``torch.cuda.set_sync_debug_mode("error")``)."""
    from megatron_mtraining.ops.backends import select_backend
    from megatron_mtraining.ops.triton import attention_delta
    from megatron_mtraining.ring.sparse import ColumnPhase

    q, k, v = (t.to("cuda", torch.bfloat16) for t in make_qkv(1, 4096, 8, 2, 64, seed=0))
    dout = torch.randn_like(q)
    layout = Layout("striped", 1, 64)
    backend = select_backend("triton", device=q.device, dtype=q.dtype, head_dim=64, seq_len_local=4096,
                             cp_size=1, sparse=True)

    def run():
        pat = estimate_vertical_slash(q, k, layout=layout, config=CFG, impl=backend.estimator_impl)
        steps = convert_pattern(pat, layout, 0, impl=backend.convert_impl)
        phase = ColumnPhase(steps, pat, layout, 0, None, None, None, 0.125)
        kernel = backend.sparse_step(steps, 0.125)
        out, lse = kernel.forward(q, k, v, 0)
        grads = kernel.backward(dout, q, k, v, lse, attention_delta(dout, out), 0)
        return kernel, pat, phase, grads

    _, ref, _, ref_grads = run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kernel, pat, phase, grads = run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert pat.same_selection(ref) and kernel.empty == [False] and phase.static
    assert all(p.static for _, p in kernel._plans.values())
    for a, b in zip(grads, ref_grads):
        assert torch.equal(a, b)          # deterministic backward: bitwise repeatable


@pytest.mark.parametrize("kind,cp", [("striped", 1), ("striped", 2), ("zigzag", 2), ("striped", 4)])
def test_column_phase_static_setup_without_host_reads(kind, cp):
    """The out-of-ring column phase with static sizes (the CUDA default) sets up under the trap on
    every rank; its padded union starts with the data-dependent one (the rest: the sentinel
    ``seq_len``), its column step lists the same columns, its gather of this rank's rows and its
    final add into dK/dV give the same values. Negative control: the data-dependent set-up trips
    the trap."""
    from megatron_mtraining.ring.sparse import ColumnPhase

    S, hkv, d = 1024, 2, 16
    q, k, v = _inputs(S, hkv=hkv, seed=cp + 7)
    pat = estimate_vertical_slash(q, k, layout=Layout("striped", 1, 64), config=CFG, impl="torch",
                                  static_widths=True)
    layout = Layout(kind, cp, 64)
    gen = torch.Generator().manual_seed(cp)
    for rank in range(cp):
        steps = convert_pattern(pat, layout, rank, impl="torch", static_widths=True)
        args = (steps, pat, layout, rank, None, None, None, 0.25)
        with HostReadTrap():
            st = ColumnPhase(*args, static=True)
        with pytest.raises(HostRead):
            with HostReadTrap():
                ColumnPhase(*args, static=False)
        dd = ColumnPhase(*args, static=False)
        u = dd.union.numel()
        assert st.n >= dd.n and torch.equal(st.union[:u], dd.union) and bool((st.union[u:] == S).all())
        a, b = st.indices, dd.indices
        assert torch.equal(a.column_count, b.column_count) and a.known_max is not None
        w = b.column_index.shape[-1]
        assert torch.equal(a.column_index[..., :w], b.column_index) and bool((a.column_index[..., w:] == -1).all())
        s_loc = S // cp
        k_loc = torch.randn(1, s_loc, hkv, d, generator=gen, dtype=torch.float64)
        v_loc = torch.randn(1, s_loc, hkv, d, generator=gen, dtype=torch.float64)
        st.begin_forward(k_loc, v_loc)
        dd.begin_forward(k_loc, v_loc)
        assert torch.equal(st._kv[:, :, :dd.n], dd._kv) and bool((st._kv[:, :, dd.n:] == 0).all())
        grads = torch.randn(2, 1, st.n, hkv, d, generator=gen, dtype=torch.float64)
        st._grads, dd._grads = grads, grads[:, :, :dd.n]
        dk0, dv0 = (torch.randn(1, s_loc, hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
        with HostReadTrap():
            dk_s, dv_s = dk0.clone(), dv0.clone()
            st.finish_backward(dk_s, dv_s)
        dk_d, dv_d = dk0.clone(), dv0.clone()
        dd.finish_backward(dk_d, dv_d)
        assert torch.equal(dk_s, dk_d) and torch.equal(dv_s, dv_d)
        assert not torch.equal(dk_d, dk0) or dd.mine_slot.numel() == 0
