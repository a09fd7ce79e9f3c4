"""The Triton step kernel's index plans with static sizes read nothing back from the device.

The forward plan and the backward plans (the inverted block index of the dK/dV kernel, the column
union and its per-tile masks of the deterministic column kernel) are built with ``static=True``
(the CUDA default) under :class:`~tests.helpers.host_reads.HostReadTrap`, which raises on every op
that makes the host wait on CUDA; the kernels themselves then run in the Triton CPU interpreter
outside the trap (the interpreter copies tensors to NumPy). Checked: the static plans' entries and
offsets are those of the data-dependent plans; out, LSE, dQ, dK, dV equal those of the
data-dependent plans (fp32, 1e-6 relative) and the fp64 masked reference (1e-5 relative), for GQA
indices per query head, per group (``share_pattern: kv_group``) and shared by every head, causal
and non-causal steps, and for the sparse ring with columns in the ring and out of it. Negative
control: the data-dependent plans trip the trap. See tests/kernels/test_triton_kernels.py for why
the interpreter is set here and how a pre-imported triton is handled.
"""

import contextlib
import dataclasses
import os
import sys

_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not _TRITON_PREIMPORTED:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from tests.helpers.host_reads import HostRead, HostReadTrap
from tests.helpers.triton_interp import rerun_in_fresh_interpreter, use_interpreted_kernels

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

import megatron_mtraining.ops.triton as triton_ops  # noqa: E402
from megatron_mtraining.ops.triton import launch, plan_for, prebuild_backward_plans  # noqa: E402
from tests.workers.gpu_common import dense_mask_rows, oracle, random_step_indices, rel_err  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreted_kernels(request):
    use_interpreted_kernels(request, _TRITON_PREIMPORTED, "megatron_mtraining.ops.triton.kernels", "_sparse_fwd_kernel")
    yield


TOL = 1e-5          # fp32 inputs against fp64
SAME = 1e-6         # static against data-dependent plans (fp32; only the column partials' split may differ)


@pytest.mark.skipif(not _TRITON_PREIMPORTED, reason="the tests below run in this process")
def test_all_in_fresh_interpreter():
    rerun_in_fresh_interpreter(__file__)


def _case(b, s, hq, hkv, heads, causal, seed, d=16):
    gen = torch.Generator().manual_seed(seed)
    idx = random_step_indices(b, heads, s // 64, s // 64, causal, gen, p_col=0.06, above_diag=causal)
    mk = lambda h: torch.randn(b, s, h, d, generator=gen) * 1.5  # noqa: E731
    q, k, v, dout = mk(hq), mk(hkv), mk(hkv), mk(hq)
    full = idx.per_query_head(hq)
    scale = d ** -0.5
    mask = lambda r0, r1: dense_mask_rows(full, r0, r1, s)  # noqa: E731
    o_ref, l_ref = oracle(q, k, v, mask, scale)
    lse_g = torch.where(torch.isinf(l_ref), l_ref, l_ref + 0.25 * torch.rand(l_ref.shape, generator=gen,
                                                                              dtype=torch.float64))
    delta_g = torch.randn(l_ref.shape, generator=gen, dtype=torch.float64)
    *_, dq_r, dk_r, dv_r, _, _ = oracle(q, k, v, mask, scale, dout, lse_g, delta_g)
    return idx, (q, k, v, dout), scale, (o_ref, l_ref, dq_r, dk_r, dv_r), (lse_g.float(), delta_g.float())


def _plans(idx, q, k, static, deterministic):
    plan = plan_for(idx, static=static)
    plan.column_split()
    prebuild_backward_plans(plan, q.shape, k.shape, deterministic)    # CPU: built in place
    return plan


def _run(plan, qkv, scale, lse_delta, deterministic):
    q, k, v, dout = qkv
    kv, col = dict(plan._kv), dict(plan._col)
    out, lse = launch.sparse_forward(q, k, v, plan, scale)
    dq, dk, dv = launch.sparse_backward(dout, q, k, v, *lse_delta, plan, scale, deterministic)
    # the backward used the plans built before (no rebuild outside the trap)
    assert plan._kv.keys() == kv.keys() and all(plan._kv[x] is kv[x] for x in kv)
    assert plan._col.keys() == col.keys() and all(plan._col[x] is col[x] for x in col)
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("b,s,hq,hkv,heads,causal", [
    (1, 256, 4, 2, 4, True),        # GQA, indices per query head
    (2, 192, 4, 2, 2, True),        # share_pattern kv_group: one index row per group, batch 2
    (1, 256, 6, 2, 2, False),       # kv_group, group size 3, non-causal step (another owner)
    (1, 192, 2, 1, 1, True),        # one index row shared by every head
])
@pytest.mark.parametrize("deterministic", [True, False])
def test_static_plans_without_host_reads(b, s, hq, hkv, heads, causal, deterministic):
    idx, qkv, scale, ref, lse_delta = _case(b, s, hq, hkv, heads, causal, seed=s + hq * 7 + heads)
    q, k = qkv[0], qkv[1]
    assert idx.num_heads == heads and bool((idx.column_count > 0).any())
    with HostReadTrap():
        plan = _plans(idx, q, k, True, deterministic)
    assert plan.static and plan._kv
    assert bool(plan._col) == (deterministic or not launch.DEFAULT_CONFIG.col_atomic_fast)
    assert not plan_for(idx).static           # the default on the CPU (and for indices without bounds)
    data = _plans(idx, q, k, False, deterministic)
    # the inverted block index: the same offsets and unmasked parts, the same entries (the static list is padded)
    (off_s, mid_s, ent_s, *shape_s), = plan._kv.values()
    (off_d, mid_d, ent_d, *shape_d), = data._kv.values()
    n = int(off_d[-1])
    assert shape_s == shape_d and torch.equal(off_s, off_d) and torch.equal(mid_s, mid_d) and ent_s.numel() >= n
    assert torch.equal(ent_s[:n], ent_d[:n])
    if plan._col:
        (cs,) = plan._col.values()
        (cd,) = data._col.values()
        assert torch.equal(cs[1], cd[1])                               # the union sizes
        u = cd[0].shape[-1]
        assert cs[0].shape[-1] >= u and torch.equal(cs[0][..., :u], cd[0])   # the union, padded wider
    got = _run(plan, qkv, scale, lse_delta, deterministic)
    base = _run(data, qkv, scale, lse_delta, deterministic)
    names = ("out", "lse", "dq", "dk", "dv")
    for name, g, r, x in zip(names, got, base, ref):
        assert not torch.isnan(g).any(), name
        assert rel_err(g, r) <= SAME, (name, rel_err(g, r))
        assert rel_err(g, x) <= TOL, (name, rel_err(g, x))


def test_static_column_union_uses_the_converter_bound():
    """Static conversions record a bound of each row's column union (``KnownMax.union``); the plan
    sizes its union buffer by it rather than by ``min(sk, nqb * max_nc)``."""
    from megatron_mtraining.layout import Layout
    from megatron_mtraining.patterns.convert import convert_pattern
    from megatron_mtraining.patterns.estimator import VerticalSlashConfig, estimate_vertical_slash
    from tests.workers.vs_data import make_qkv

    q, k, _ = make_qkv(1, 512, 2, 1, 16, seed=3)
    cfg = VerticalSlashConfig(recall=0.9, last_q=64, sink_tokens=16, local_blocks=1, max_vertical=40, max_slash=4)
    pat = estimate_vertical_slash(q, k, layout=Layout("striped", 1, 64), config=cfg, impl="torch", static_widths=True)
    (st,) = convert_pattern(pat, Layout("striped", 1, 64), 0, impl="torch", static_widths=True)
    assert st.known_max.union == st.column_index.shape[-1] == 40
    with HostReadTrap():
        plan = plan_for(st, static=True)
        prebuild_backward_plans(plan, q.shape, k.shape, True)
    (col,) = plan._col.values()
    assert plan.column_union_max == 40 and col[0].shape[-1] == 64      # one 64-column chunk, not 512 / 64
    assert not plan_for(st).static                                      # the default on the CPU
    assert int(col[1].max()) <= 40


def test_data_dependent_plans_trip_the_trap():
    """Negative control: the data-dependent backward plans read the device (``nonzero``, boolean
    indexing, the union width)."""
    idx, qkv, *_ = _case(1, 128, 2, 1, 2, True, seed=1)
    for deterministic in (True, False):
        plan = plan_for(idx, static=False)
        with pytest.raises(HostRead):
            with HostReadTrap():
                prebuild_backward_plans(plan, qkv[0].shape, qkv[1].shape, deterministic)
    plan = plan_for(idx, static=True)
    plan._kv[("kv", 2, 2, 1)] = launch._kv_csr_static(plan.block_index, torch.arange(plan.block_index.shape[-1])
                                                      < plan.block_count[..., None], 2, 2, 1)
    plan.static = False             # the column plan alone, data-dependent
    with pytest.raises(HostRead):
        with HostReadTrap():
            prebuild_backward_plans(plan, qkv[0].shape, qkv[1].shape, True)


def _trapped(fn):
    def run(*args, **kwargs):
        with HostReadTrap():
            return fn(*args, **kwargs)
    return run


def _ring(q, k, v, dout, columns, share, static, monkeypatch):
    """The sparse ring (cp=1) on the Triton step kernel; with ``static`` the estimator and the
    conversion use static widths and every plan the kernel builds (forward, backward, the column
    phase's set-up) runs under the trap. Returns (out, dq, dk, dv), the pattern and the kernel."""
    from megatron_mtraining.layout import Layout
    from megatron_mtraining.ops.backends import select_backend
    from megatron_mtraining.patterns.estimator import VerticalSlashConfig
    import megatron_mtraining.ring.sparse as sparse_mod

    s, d = q.shape[1], q.shape[-1]
    base = select_backend("triton", device="cpu", dtype=torch.float32, head_dim=d, seq_len_local=s, sparse=True)
    kernels = []

    def factory(steps, scale):
        kern = base.sparse_step(steps, scale)
        kern.static_plans = static
        kernels.append(kern)
        return kern

    with monkeypatch.context() as mp:
        if static:
            for name in ("estimate_vertical_slash", "convert_pattern"):
                fn = getattr(sparse_mod, name)
                mp.setattr(sparse_mod, name, lambda *a, _fn=fn, **kw: _fn(*a, static_widths=True, **kw))
            mp.setattr(triton_ops, "plan_for", _trapped(triton_ops.plan_for))
            mp.setattr(triton_ops, "prebuild_backward_plans", _trapped(triton_ops.prebuild_backward_plans))
            mp.setattr(launch, "_kv_csr", _trapped(launch._kv_csr))
            mp.setattr(launch, "_col_plan", _trapped(launch._col_plan))
            mp.setattr(launch.SparsePlan, "column_split", _trapped(launch.SparsePlan.column_split))

            class TrappedColumnPhase(sparse_mod.ColumnPhase):
                def __init__(self, *args, **kwargs):
                    with HostReadTrap():
                        super().__init__(*args, static=True, **kwargs)
            mp.setattr(sparse_mod, "ColumnPhase", TrappedColumnPhase)
        qa, ka, va = (t.float().requires_grad_(True) for t in (q, k, v))
        out, pat = sparse_mod.sparse_ring_attention(
            qa, ka, va, layout=Layout("striped", 1, 64), group=None,
            config=VerticalSlashConfig(recall=0.9, local_blocks=1, share_pattern=share), softmax_scale=d ** -0.5,
            return_pattern=True, backend=dataclasses.replace(base, sparse_step=factory), columns=columns)
        out.backward(dout.float())
    return (out.detach(), qa.grad, ka.grad, va.grad), pat, kernels[0]


@pytest.mark.parametrize("columns,share", [("in_ring", "head"), ("out_of_ring", "kv_group"),
                                           ("in_ring", "kv_group"), ("out_of_ring", "head")])
def test_sparse_ring_with_static_plans_without_host_reads(columns, share, monkeypatch):
    """The sparse ring with static widths and static plans (the CUDA path) builds every index plan
    under the trap; out, dQ, dK, dV equal those of the data-dependent path (the CPU default) and
    the fp64 attention masked with the estimated pattern."""
    from tests.workers.vs_data import make_qkv, naive_masked_attention

    s, hq, hkv, d = 256, 4, 2, 16
    q, k, v = make_qkv(1, s, hq, hkv, d, seed=11)
    dout = torch.randn(1, s, hq, d, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    got, pat, kern = _ring(q, k, v, dout, columns, share, True, monkeypatch)
    base, pat_d, kern_d = _ring(q, k, v, dout, columns, share, False, monkeypatch)
    plans = [p for _, p in kern._plans.values()]
    assert plans and all(p.static for p in plans) and not any(p.static for _, p in kern_d._plans.values())
    assert all(p.diagonal for _, p in kern_d._plans.values() if p.block_index.shape[-1] > 1)   # cp 1 steps
    # the backward plans were built (under the trap); columns-only steps (the column phase's) need no inverted
    # block index (SparsePlan.no_blocks), only their column plan
    assert all(p._col if p.no_blocks else p._kv for p in plans)
    assert any(p.no_blocks for p in plans) == (columns == "out_of_ring")
    assert (kern.column_phase is not None) == (columns == "out_of_ring")
    if columns == "out_of_ring":
        assert kern.column_phase.static and not kern_d.column_phase.static
        assert kern.column_phase.n >= kern_d.column_phase.n
    else:
        assert any(p.has_columns for p in plans)
    assert pat.same_selection(pat_d)
    mask = pat.dense_mask()
    assert bool(pat.vertical_mask().any())
    if mask.shape[1] != hq:
        mask = mask.repeat_interleave(hq // mask.shape[1], dim=1)
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = naive_masked_attention(qr, kr, vr, mask, d ** -0.5)
    ref.backward(dout)
    for name, g, b, r in zip(("out", "dq", "dk", "dv"), got, base, (ref, qr.grad, kr.grad, vr.grad)):
        assert rel_err(g, b) <= SAME, (name, rel_err(g, b))
        assert rel_err(g, r) <= TOL, (name, rel_err(g, r))


def test_data_dependent_column_phase_trips_the_trap():
    """Negative control: the column phase's data-dependent set-up (``unique``, ``nonzero``, checks)
    reads the device; the static one does not."""
    from megatron_mtraining.layout import Layout
    from megatron_mtraining.patterns.convert import convert_pattern
    from megatron_mtraining.patterns.estimator import VerticalSlashConfig, estimate_vertical_slash
    from megatron_mtraining.ring.sparse import ColumnPhase
    from tests.workers.vs_data import make_qkv

    q, k, _ = make_qkv(1, 256, 2, 1, 16, seed=2)
    layout = Layout("striped", 1, 64)
    pat = estimate_vertical_slash(q, k, layout=layout, config=VerticalSlashConfig(recall=0.9, local_blocks=1),
                                  impl="torch", static_widths=True)
    steps = convert_pattern(pat, layout, 0, impl="torch", static_widths=True)
    args = (steps, pat, layout, 0, None, None, None, 0.25)
    with pytest.raises(HostRead):
        with HostReadTrap():
            ColumnPhase(*args, static=False)
    with HostReadTrap():
        phase = ColumnPhase(*args, static=True)
    assert not phase.empty and phase.indices.known_max is not None


def _csr(plan, nkb, hq, hkv):
    off, mid, ent, *shape = launch._kv_csr(plan, nkb, hq, hkv)
    return off, mid, ent[:int(off[-1])], shape


@pytest.mark.parametrize("scan_block", [launch._SCAN_BLOCK, 8])   # 8: the offsets scan takes several steps
@pytest.mark.parametrize("heads,hq,hkv", [(4, 4, 2), (2, 6, 2), (1, 2, 1)])     # per query head, per group, shared
def test_diagonal_plans_equal_the_sorted_ones(heads, hq, hkv, scan_block, monkeypatch):
    """Block lists known to be block diagonals (:class:`DiagonalBlocks`: the converter at cp 1, the
    synthetic patterns) build the causal split and the inverted block index from each row's offsets,
    without a sort and, static, without a host read: the same split, offsets, mids and entries as the
    sorted plans. Negative controls: an index edited in place loses the record; a non-diagonal index
    forced through the diagonal path gives another index."""
    from megatron_mtraining.patterns.synthetic import vertical_slash_indices

    monkeypatch.setattr(launch, "_SCAN_BLOCK", scan_block)

    s = 640
    nkb = s // 64
    idx, _ = vertical_slash_indices(s, heads, 0.6, batch=2)
    assert idx.diagonal_blocks
    for static in (True, False):
        with HostReadTrap():
            diag = plan_for(idx, static=static)
            launch._kv_csr(diag, nkb, hq, hkv)              # cached on the plan
        assert diag.diagonal
        got = _csr(diag, nkb, hq, hkv)
        ref = launch.plan_from_indices(idx.block_count, idx.block_index, idx.column_count, idx.column_index, True,
                                       static=static)
        assert not ref.diagonal and torch.equal(diag.block_split, ref.block_split)
        rows = launch._diagonal_rows(idx.block_index.to(torch.int32), idx.block_count.to(torch.int32), True)
        assert all(torch.equal(a, b) for a, b in zip(diag._diag_rows, rows))      # the kernel's, as torch's
        want = _csr(ref, nkb, hq, hkv)
        for name, g, w in zip(("offsets", "mids", "entries"), got, want):
            assert torch.equal(g, w), name
        assert got[3] == want[3]
    edited = dataclasses.replace(idx, block_index=idx.block_index.clone())
    edited.block_index[0, 0, -1, 0] += 0          # an in-place write bumps the version
    assert not edited.diagonal_blocks and not plan_for(edited).diagonal
    gen = torch.Generator().manual_seed(5)
    rnd = random_step_indices(1, hq, nkb, nkb, True, gen)
    forced = launch.plan_from_indices(rnd.block_count, rnd.block_index.clamp(min=-1), rnd.column_count,
                                      rnd.column_index, True, diagonal=True)
    plain = launch.plan_from_indices(rnd.block_count, rnd.block_index.clamp(min=-1), rnd.column_count,
                                     rnd.column_index, True)
    assert not all(torch.equal(a, b) for a, b in zip(_csr(forced, nkb, hq, hkv)[:3], _csr(plain, nkb, hq, hkv)[:3]))


@pytest.mark.parametrize("kind,cp,gran,marked", [("striped", 1, 64, True), ("striped", 4, 64, True),
                                                  ("contiguous", 4, 64, False), ("striped", 2, 128, False),
                                                  ("zigzag", 2, 64, False)])
def test_converter_marks_diagonal_blocks_where_the_layout_keeps_them(kind, cp, gran, marked):
    """The conversion records its block lists as diagonals at cp 1 and on every ring step of the striped
    layout with one block per stripe, and the plans built from the record equal the sorted ones (causal
    own step, non-causal steps of the other owners); it records nothing for the other layouts (negative
    control: some of their steps are not diagonals, e.g. contiguous chunks, where a later rank lists an
    earlier owner's key blocks right of the query block). torch and Triton conversions at cp 1."""
    from megatron_mtraining.layout import Layout
    from megatron_mtraining.patterns.convert import convert_pattern, without_columns
    from megatron_mtraining.patterns.estimator import VerticalSlashConfig, estimate_vertical_slash
    from tests.workers.vs_data import make_qkv

    s = 1024
    q, k, _ = make_qkv(1, s, 2, 1, 16, seed=4)
    cfg = VerticalSlashConfig(recall=0.95, last_q=64, sink_tokens=16, local_blocks=1, max_vertical=40, max_slash=6)
    layout = Layout(kind, cp, gran)
    pat = estimate_vertical_slash(q, k, layout=Layout("striped", 1, 64), config=cfg, impl="torch")
    differ = []
    for impl in (("torch", "triton") if cp == 1 else ("torch",)):
        for rank in range(cp):
            steps = convert_pattern(pat, layout, rank, impl=impl)
            assert [x.diagonal_blocks for x in steps] == [marked] * cp
            for st in steps:
                nkb = st.block_index.shape[-2]
                forced = launch.plan_from_indices(st.block_count, st.block_index, st.column_count, st.column_index,
                                                  st.causal, diagonal=True)
                ref = launch.plan_from_indices(st.block_count, st.block_index, st.column_count, st.column_index,
                                               st.causal)
                same = torch.equal(forced.block_split, ref.block_split) and all(
                    torch.equal(a, b) for a, b in zip(_csr(forced, nkb, 2, 1)[:3], _csr(ref, nkb, 2, 1)[:3]))
                if marked:          # steps that list no block get a plan without block structures instead
                    plan = plan_for(st)
                    assert same and (plan.diagonal or (plan.no_blocks and int(st.block_count.max()) == 0))
                    assert without_columns(st).diagonal_blocks and st.per_query_head(4).diagonal_blocks
                differ.append(not same)
    assert any(differ) != marked


def test_leading_below_kernel_equals_the_torch_split():
    """The causal splits (blocks left of the tile, columns left of its first row) by the kernel that
    reads each row only up to its first failing slot equal the torch ``_leading_split`` of the same
    rule, for ascending and shuffled lists, garbage padding, empty rows and a batch expanded from one
    row, without a host read. Negative control: a split one too long differs."""
    gen = torch.Generator().manual_seed(9)
    idx = random_step_indices(2, 3, 6, 6, True, gen, p_col=0.1, above_diag=True)
    shuffled = idx.column_index.clone()
    perm = torch.randperm(shuffled.shape[-1], generator=gen)
    shuffled[..., :] = shuffled[..., perm]
    one = random_step_indices(1, 2, 5, 5, True, gen, p_col=0.1)
    cases = [(idx.block_index, idx.block_count, 1), (idx.column_index, idx.column_count, 64),
             (shuffled, idx.column_count, 64), (one.column_index.expand(3, -1, -1, -1), one.column_count, 64),
             (one.column_index[:, :1], one.column_count, 64)]            # one shared row, counts per head
    cut = []
    for index, count, scale in cases:
        with HostReadTrap():
            got = launch._leading_below(index, count, scale)
        nqb = index.shape[-2]
        tile = torch.arange(nqb, dtype=torch.int32)[:, None] * scale
        want = launch._leading_split(index, count, index < tile)
        assert torch.equal(got, want) and not torch.equal(got + 1, want)
        cut.append(bool((got < count).any()))
    assert cut[:3] == [True, True, True]          # slots that fail the rule inside the count


@pytest.mark.parametrize("scan_block", [launch._SCAN_BLOCK, 8])   # 8: the union scan takes many steps
def test_column_plan_kernels_equal_the_torch_ops(monkeypatch, scan_block):
    """The deterministic column plan built by the kernels that read only the listed slots (present
    columns, per-tile chunk masks by atomic OR, then per segment counts and prefix sums instead of a
    sort) and scan each row once (union ranks and the union) equals the torch ops over every slot: the
    union, its size, the CSR offsets and mid and the entries, static and data dependent; for GQA rows
    with garbage padding, shuffled lists, a non-causal step, a batch shared by one index and a tile
    whose listed columns spread over many union chunks."""
    monkeypatch.setattr(launch, "_SCAN_BLOCK", scan_block)
    from megatron_mtraining.patterns.synthetic import vertical_slash_indices

    gen = torch.Generator().manual_seed(3)
    rnd = random_step_indices(2, 3, 6, 6, True, gen, p_col=0.1, above_diag=True)
    slot = torch.arange(rnd.column_index.shape[-1])
    cc = rnd.column_count[..., None].long()
    rev = torch.where(slot < cc, cc - 1 - slot, slot)            # each row's listed columns in reverse order
    shuffled = dataclasses.replace(rnd, column_index=rnd.column_index.gather(-1, rev))
    cases = [(vertical_slash_indices(768, 2, 0.6, batch=2)[0], 2, 4), (rnd, 2, 6), (shuffled, 2, 3),
             (random_step_indices(1, 2, 5, 5, False, gen, p_col=0.2), 1, 2)]
    def same_plans(make, sk, b, hq, trap=False):
        """Both column plans of ``make()`` (kernels, under a host-read trap if ``trap``; torch ops), equal
        in every output with the entries cut at the real count; returns ``(count, torch plan)``."""
        with HostReadTrap() if trap else contextlib.nullcontext():
            got = launch._col_plan(make(), sk, b, hq)
        with monkeypatch.context() as mp:
            mp.setattr(launch, "triton_runs_on", lambda device: False)
            want = launch._col_plan(make(), sk, b, hq)
        assert len(got) == len(want)
        n = int(want[2][-1])
        assert got[4].numel() >= n and got[5].numel() >= n
        got, want = list(got), list(want)
        got[4:6], want[4:6] = [t[:n] for t in got[4:6]], [t[:n] for t in want[4:6]]   # the entries (buffers padded)
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w) if isinstance(g, torch.Tensor) else g == w, i
        return n, want

    for idx, b, hq in cases:
        sk = idx.block_index.shape[-2] * 64
        for static in (True, False):
            same_plans(lambda: plan_for(idx, static=static), sk, b, hq, trap=static)  # noqa: B023
    # a union bound below the real union drops the columns past it (never another tile's chunk), by 36
    # columns and by more than a chunk (the torch ops' scatters stay inside their buffers)
    nqb = 4
    bc, bi = torch.zeros(1, 1, nqb, dtype=torch.int32), torch.zeros(1, 1, nqb, 1, dtype=torch.int32)
    for ncols in (100, 200):
        ci, cc = torch.zeros(1, 1, nqb, ncols, dtype=torch.int32), torch.zeros(1, 1, nqb, dtype=torch.int32)
        ci[0, 0, 0], cc[0, 0, 0] = torch.arange(ncols, dtype=torch.int32), ncols
        n, want = same_plans(lambda: launch.plan_from_indices(bc, bi, cc, ci, False, static=True,  # noqa: B023
                                                              column_union_max=64), nqb * 64, 1, 1)
        assert n == 1 and int(want[5][0]) == -1      # the 64 kept columns
    # a tile whose 64 listed columns are spread over ten union chunks (one atomic per column), next to
    # tiles whose steps fall in one or two chunks (one OR-reduction per chunk)
    nqb = 3
    bc, bi = torch.zeros(1, 1, nqb, dtype=torch.int32), torch.zeros(1, 1, nqb, 1, dtype=torch.int32)
    ci, cc = torch.full((1, 1, nqb, 640), -1, dtype=torch.int32), torch.tensor([[[640, 64, 70]]], dtype=torch.int32)
    ci[0, 0, 0], ci[0, 0, 1, :64], ci[0, 0, 2, :70] = torch.arange(640), torch.arange(0, 640, 10), torch.arange(3, 73)
    n, _ = same_plans(lambda: launch.plan_from_indices(bc, bi, cc, ci, False, static=True), 640, 1, 1)
    assert n == 10 + 10 + 2


@pytest.mark.parametrize("nqb", [5, 600])
def test_diagonal_split_kernel_equals_torch(monkeypatch, nqb):
    """The diagonal rows and causal split in one kernel launch equal the torch ops' on rows with an empty last
    tile, without and with its own block (offset 0), and on a strided (non-contiguous) index, with the query
    tiles in one program or over several (600 > 256 per program). Negative control: a row's last list changed
    gives other rows."""
    gen = torch.Generator().manual_seed(11)
    B_, H_, W = 2, 3, 4
    wide = torch.full((B_, H_, nqb, W + 2), -1, dtype=torch.int32)
    bc = torch.zeros((B_, H_, nqb), dtype=torch.int32)
    for b in range(B_):
        for h in range(H_):
            for q in range(nqb):
                n = int(torch.randint(0, min(W, q + 1) + 1, (1,), generator=gen))
                ks = sorted(torch.randperm(q + 1, generator=gen)[:n].tolist())
                wide[b, h, q, :n] = torch.tensor(ks, dtype=torch.int32)
                bc[b, h, q] = n
    wide[0, 0, -1, :2], bc[0, 0, -1] = torch.tensor([1, nqb - 1], dtype=torch.int32), 2    # offset 0 listed
    wide[0, 1, -1, :2], bc[0, 1, -1] = torch.tensor([0, 2], dtype=torch.int32), 2          # offset 0 not listed
    bc[1, 2, -1] = 0                                                                        # empty last tile
    bi = wide[..., :W]                                                                      # strided view
    assert not bi.is_contiguous()
    (last, n, h0), split = launch._diagonal_split(bi, bc)
    monkeypatch.setattr(launch, "triton_runs_on", lambda device: False)
    (t_last, t_n, t_h0), t_split = launch._diagonal_split(bi, bc)
    for name, g, w in (("last", last, t_last), ("n", n, t_n), ("h0", h0, t_h0), ("split", split, t_split)):
        assert g.dtype == w.dtype == torch.int32 and torch.equal(g, w), name
    assert h0[0, 0] == 1 and h0[0, 1] == 0 and h0[1, 2] == 0 and n[1, 2] == 0
    monkeypatch.undo()
    bi2 = bi.clone()
    bi2[0, 0, -1, 0] = 3
    assert not torch.equal(launch._diagonal_split(bi2, bc)[0][0], last)


def test_union_rows_kernel_equals_torch(monkeypatch):
    """A given column union padded to the plan's width (padding as 0) and its sizes in one kernel launch equal
    the torch ops, on rows of every size (none to full) and on a strided union; negative control: another
    union gives other sizes."""
    gen = torch.Generator().manual_seed(12)
    B_, H_, nv, upad = 2, 3, 70, 128
    wide = torch.full((B_, H_ + 1, nv), -1, dtype=torch.int32)
    for r, n in enumerate((0, 1, 5, 33, 69, 70)):
        b, h = divmod(r, H_)
        wide[b, h, :n] = torch.sort(torch.randperm(4 * nv, generator=gen)[:n]).values.to(torch.int32)
    union = wide[:, :H_]
    assert not union.is_contiguous()
    got = launch._union_rows(union, upad)
    monkeypatch.setattr(launch, "triton_runs_on", lambda device: False)
    want = launch._union_rows(union, upad)
    for name, g, w in zip(("col_u", "ucount"), got, want):
        assert g.dtype == w.dtype == torch.int32 and g.shape == w.shape and torch.equal(g, w), name
    assert got[1].flatten().tolist() == [0, 1, 5, 33, 69, 70]
    monkeypatch.undo()
    assert not torch.equal(launch._union_rows(union[:, :, :40], upad)[1], got[1])
