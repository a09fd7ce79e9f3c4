"""Packed sequences on one process: the document maps of ``layout.documents``, the document-masked
torch step kernel in a simulated ring (every rank's steps and the LSE merge) against an fp64
per-document reference (each document attended alone), and the ring entry points at CP=1.

out, dQ, dK, dV are compared separately (fp64 <= 1e-10, fp32 <= 1e-5, relative to the largest
reference magnitude); padding must give exact zeros and no NaN.
"""
import itertools

import pytest
import torch

from megatron_mtraining.layout import Layout, PackedDocuments, cu_seqlens_from_eod
from megatron_mtraining.ops.backends import select_backend
from megatron_mtraining.ops.reference import DenseStepKernel, document_tiles
from megatron_mtraining.ring import ring_attention
from tests.helpers.packed_ref import per_document_attention, rel_err
from tests.helpers.ring_sim import simulate_dense_ring

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
S = 128   # 2 * cp * block for cp 4 and 16-token stripes


# ----------------------------------------------------------------------------- document maps
def test_maps_of_contiguous_documents():
    docs = PackedDocuments.from_cu_seqlens(torch.tensor([0, 3, 4, 8]), seq_len=10)
    assert docs.lo.tolist() == [[0, 0, 0, 3, 4, 4, 4, 4, 10, 10]]
    assert docs.hi.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, -1, -1]]
    lay = Layout("striped", 2, 1)
    assert docs.positions(lay, 0).tolist() == [[0, 2, 0, 2, 0]]     # global 0 2 4 6 8
    assert docs.positions(lay, 1).tolist() == [[1, 0, 1, 3, 0]]     # global 1 3 5 7 9
    assert docs.num_documents == 3 and not docs.single_document


def test_maps_of_padded_documents_and_rows():
    # two rows of 8; documents [0,3) and [8,13) of slots [0,8) and [8,16)
    docs = PackedDocuments.from_cu_seqlens([0, 3, 8], 8, batch_size=2, cu_seqlens_padded=[0, 8, 16])
    assert docs.hi.tolist() == [[0, 1, 2, -1, -1, -1, -1, -1], [0, 1, 2, 3, 4, -1, -1, -1]]
    assert docs.real().sum().item() == 8


def test_single_document_is_flagged():
    assert PackedDocuments.from_cu_seqlens([0, 64], 64).single_document
    assert PackedDocuments.from_cu_seqlens([0, 64, 128], 64, batch_size=2).single_document
    assert not PackedDocuments.from_cu_seqlens([0, 60], 64).single_document          # padding
    assert not PackedDocuments.from_cu_seqlens([0, 30, 64], 64).single_document


def test_eod_boundaries_follow_megatron_reset_rule():
    """The EOD token ends its document (Megatron-LM's --reset-attention-mask / --reset-position-ids)."""
    eod = 7
    tokens = torch.tensor([[1, 2, eod, 3, eod, eod, 4, 5], [eod, 1, 1, 1, 1, 1, 1, 1]])
    assert cu_seqlens_from_eod(tokens, eod).tolist() == [0, 3, 5, 6, 8, 9, 16]
    docs = PackedDocuments.from_eod(tokens, eod)
    pos = docs.positions(Layout("striped", 1, 1), 0)
    # independent: Megatron's loop (position_ids[(i+1):] -= i + 1 - prev) per row
    for r in range(2):
        expect = list(range(8))
        prev = 0
        for i in [j for j in range(8) if tokens[r, j] == eod]:
            expect = expect[:i + 1] + [p - (i + 1 - prev) for p in expect[i + 1:]]
            prev = i + 1
        assert pos[r].tolist() == expect


@pytest.mark.parametrize("kw, msg", [
    (dict(cu_seqlens=[1, 5]), "must start at 0"),
    (dict(cu_seqlens=[0, 5, 3]), "non-decreasing"),
    (dict(cu_seqlens=[0, 20]), "the batch holds"),
    (dict(cu_seqlens=[0.0, 4.0]), "integer tensor"),
    (dict(cu_seqlens=[[0, 4]]), "1-D tensor"),
    (dict(cu_seqlens=[0, 5], cu_seqlens_padded=[0, 4]), "padded slot"),
    (dict(cu_seqlens=[0, 5], cu_seqlens_padded=[0, 5, 6]), "has 3 entries"),
    (dict(cu_seqlens=[0, 4, 12], batch_size=2), "crosses the boundary"),
])
def test_bad_offsets_name_the_rule(kw, msg):
    kw = {"seq_len": 8, **kw}
    with pytest.raises(ValueError, match=msg):
        PackedDocuments.from_cu_seqlens(**kw)


# ----------------------------------------------------------------------------- simulated ring
LAYOUTS = [Layout("striped", 1, 64), Layout("striped", 2, 16), Layout("striped", 4, 16), Layout("striped", 4, 1),
           Layout("zigzag", 2), Layout("zigzag", 4)]
# lengths 1 ... 2*cp*block, none dividing anything, documents straddling stripes and ranks
DOCS = {
    "mixed": ([0, 1, 8, 41, 43, 107, 128], None),
    "padded": ([0, 5, 30, 31], [0, 8, 40, 48]),         # tokens 48..127 padding: rank 3 of striped-16 cp 4 holds none
    "one_token_docs": (list(range(0, 17)) + [128], None),
}


def _qkv(b, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, S, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, S, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, S, hkv, d, generator=g, dtype=torch.float64)
    do = torch.randn(b, S, hq, d, generator=g, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (q, k, v, do))


def _sim(layout, q, k, v, do, docs, scale):
    return simulate_dense_ring(layout, q, k, v, do,
                               lambda r: DenseStepKernel(layout, r, S, scale, True, documents=docs),
                               acc=torch.float64 if q.dtype == torch.float64 else torch.float32)


@pytest.mark.parametrize("layout, name, heads, dtype", list(itertools.product(
    LAYOUTS, DOCS, [(4, 4), (4, 1)], [torch.float64, torch.float32])))
def test_simulated_ring_matches_per_document_reference(layout, name, heads, dtype):
    hq, hkv = heads
    cu, padded = DOCS[name]
    d = 16
    q, k, v, do = _qkv(1, hq, hkv, d, dtype)
    docs = PackedDocuments.from_cu_seqlens(torch.tensor(cu), S, cu_seqlens_padded=padded)
    out, _, dq, dk, dv = _sim(layout, q, k, v, do, docs, d ** -0.5)
    ref = per_document_attention(q, k, v, do, cu, d ** -0.5, padded)
    for name_, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
        assert torch.isfinite(got).all(), name_
        assert rel_err(got, want) <= TOL[dtype], (name_, rel_err(got, want))
    pad = ~docs.real()[0]
    if pad.any():                                       # padding: exact zeros everywhere
        for got in (out, dq, dk, dv):
            assert torch.equal(got[0, pad], torch.zeros_like(got[0, pad]))


def test_batch_of_two_streams_with_different_documents():
    q, k, v, do = _qkv(2, 4, 2, 16, torch.float64, seed=3)
    cu = [0, 10, 77, 128, 129, 200, 250]                 # row 0: 10 | 67 | 51; row 1: 1 | 71 | 50, then padding
    docs = PackedDocuments.from_cu_seqlens(torch.tensor(cu), S, batch_size=2)
    for layout in (Layout("striped", 4, 16), Layout("zigzag", 2)):
        out, _, dq, dk, dv = _sim(layout, q, k, v, do, docs, 0.25)
        ref = per_document_attention(q, k, v, do, cu, 0.25)
        for got, want in zip((out, dq, dk, dv), ref):
            assert rel_err(got, want) <= 1e-10


def test_negative_control_without_the_document_mask_fails():
    cu, _ = DOCS["mixed"]
    q, k, v, do = _qkv(1, 4, 1, 16, torch.float64)
    lay = Layout("striped", 2, 16)
    out, _, dq, _, _ = simulate_dense_ring(lay, q, k, v, do, lambda r: DenseStepKernel(lay, r, S, 0.25),
                                           acc=torch.float64)
    ref = per_document_attention(q, k, v, do, cu, 0.25)
    assert rel_err(out, ref[0]) > 1e-2 and rel_err(dq, ref[1]) > 1e-2


# ----------------------------------------------------------------------------- work skipping
def test_tiles_skip_key_blocks_of_other_documents():
    """Documents of 64 aligned with the 64-row tiles: each tile computes its own document's keys only."""
    pos = torch.arange(256)
    docs = PackedDocuments.from_cu_seqlens([0, 64, 128, 192, 256], 256)
    lo, hi = docs.key_bounds(Layout("striped", 1, 64), 0)
    assert document_tiles(lo, hi, pos) == [(0, 64, 0, 64), (64, 128, 64, 128), (128, 192, 128, 192),
                                           (192, 256, 192, 256)]
    # a boundary inside a tile: the tile spans both documents' keys (masked exactly, checked above)
    docs = PackedDocuments.from_cu_seqlens([0, 100, 256], 256)
    lo, hi = docs.key_bounds(Layout("striped", 1, 64), 0)
    assert document_tiles(lo, hi, pos)[1] == (64, 128, 0, 128)
    assert document_tiles(lo, hi, pos)[2] == (128, 192, 100, 192)


def test_padding_rank_and_foreign_steps_cost_nothing():
    cu, padded = DOCS["padded"]
    docs = PackedDocuments.from_cu_seqlens(cu, S, cu_seqlens_padded=padded)
    lay = Layout("striped", 4, 16)
    idle = DenseStepKernel(lay, 3, S, 1.0, documents=docs)       # stripes 48..63 and 112..127: all padding
    assert all(idle.tiles(o) == [] and not idle.visible(o) for o in range(4))
    q = torch.zeros(1, S // 4, 2, 8)
    assert idle.forward(q, q, q, 0) is None
    # rank 0 holds tokens 0..15 and 64..79: only owner 0's keys share its documents
    k0 = DenseStepKernel(lay, 0, S, 1.0, documents=docs)
    assert [k0.visible(o) for o in range(4)] == [True, False, False, False]


# ----------------------------------------------------------------------------- ring entry points
def test_ring_single_document_equals_unpacked_path_bitwise():
    q, k, v, do = _qkv(1, 4, 2, 16, torch.float64)
    lay = Layout("striped", 1, 64)
    docs = PackedDocuments.from_cu_seqlens([0, S], S)
    xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ys = [t.clone().requires_grad_(True) for t in (q, k, v)]
    a = ring_attention(*xs, layout=lay)
    b = ring_attention(*ys, layout=lay, documents=docs)
    a.backward(do)
    b.backward(do)
    assert torch.equal(a, b)
    for x, y in zip(xs, ys):
        assert torch.equal(x.grad, y.grad)


def test_ring_cp1_packed_matches_reference_and_refuses_other_kernels():
    cu, padded = DOCS["padded"]
    q, k, v, do = _qkv(1, 4, 2, 16, torch.float64)
    docs = PackedDocuments.from_cu_seqlens(cu, S, cu_seqlens_padded=padded)
    xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = ring_attention(*xs, layout=Layout("striped", 1, 64), documents=docs)
    out.backward(do)
    ref = per_document_attention(q, k, v, do, cu, 0.25, padded)
    for got, want in zip((out, *(x.grad for x in xs)), ref):
        assert rel_err(got, want) <= 1e-10
    with pytest.raises(ValueError, match="packed documents describe 128-token streams"):
        ring_attention(q[:, :64], k[:, :64], v[:, :64], layout=Layout("striped", 1, 64), documents=docs)
    with pytest.raises(ValueError, match="kernel_backend='sdpa' cannot run packed sequences"):
        select_backend("sdpa", device="cpu", dtype=torch.float32, head_dim=64, packed=True)
    with pytest.raises(ValueError, match="kernel_backend='fa4' cannot run packed sequences .* at cp_size 2"):
        select_backend("fa4", device="cpu", dtype=torch.float32, head_dim=64, packed=True, cp_size=2)
    with pytest.raises(ValueError, match="kernel_backend='fa4' cannot run these inputs: FlashAttention-4 needs a CUDA"):
        select_backend("fa4", device="cpu", dtype=torch.float32, head_dim=64, packed=True)
    assert select_backend("auto", device="cpu", dtype=torch.float32, head_dim=64, packed=True).name == "torch"
    tri = select_backend("triton", device="cpu", dtype=torch.float32, head_dim=64, packed=True, triton_available=True)
    assert tri.name == "triton" and tri.packed_cp1 is None
    # on CUDA without FA4, auto keeps the Triton steps for packed documents, never SDPA (FA4 varlen
    # where it is available: tests/unit/test_fa4_varlen.py)
    cuda = select_backend("auto", device="cuda", dtype=torch.bfloat16, head_dim=64, packed=True,
                          triton_available=True, fa4_available=False)
    assert cuda.name == "triton" and cuda.dense_cp1 is None and cuda.packed_cp1 is None


@pytest.mark.parametrize("layout", [Layout("striped", 2, 16), Layout("striped", 4, 1), Layout("zigzag", 4)])
def test_positions_per_local_token_equal_the_unsharded_ones(layout):
    """Every local token's RoPE position is its position inside its document, whatever stripe or
    rank it lands on (documents straddling stripes included)."""
    cu, padded = DOCS["mixed"]
    docs = PackedDocuments.from_cu_seqlens(cu, S, cu_seqlens_padded=padded)
    whole = torch.tensor([p - max(c for c in cu if c <= p) for p in range(S)])[None]   # independent
    assert torch.equal(docs.positions(Layout("striped", 1, 64), 0), whole)
    for r in range(layout.cp_size):
        assert torch.equal(docs.positions(layout, r), layout.shard(whole, r, dim=1))


def test_agreement_key_tells_offsets_apart():
    """Different offsets give different keys; before, a weighted checksum mod 1000003 made these two equal."""
    a = PackedDocuments.from_cu_seqlens(torch.tensor([0, 10, 256, 300, 512]), seq_len=512)
    b = PackedDocuments.from_cu_seqlens(torch.tensor([0, 13, 254, 300, 512]), seq_len=512)
    weighted = lambda cu: sum(x * w for x, w in zip(cu, range(1, len(cu) + 1))) % 1000003
    assert weighted(a.cu_seqlens) == weighted(b.cu_seqlens)       # the collision the key must not have
    assert a.agreement_key() != b.agreement_key()
    # padded offsets count too; equal documents give equal keys (negative control)
    c = PackedDocuments.from_cu_seqlens(torch.tensor([0, 10, 250, 294, 506]), seq_len=512,
                                        cu_seqlens_padded=torch.tensor([0, 16, 256, 300, 512]))
    c2 = PackedDocuments.from_cu_seqlens(torch.tensor([0, 10, 250, 294, 506]), seq_len=512,
                                         cu_seqlens_padded=torch.tensor([0, 10, 256, 300, 512]))
    assert c.cu_seqlens == c2.cu_seqlens and c.agreement_key() != c2.agreement_key()
    assert a.agreement_key() == PackedDocuments.from_cu_seqlens([0, 10, 256, 300, 512], seq_len=512).agreement_key()
    assert len(a.agreement_key()) <= 7    # one field slot of the cross-rank check holds at most 7 integers
