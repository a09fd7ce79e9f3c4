"""FlashAttention-4 varlen for packed dense attention at CP=1, on the CPU: the THD flattening of
packed streams (pure), the glue around the varlen call checked with a torch stand-in for FA4's
``flash_attn_varlen_func`` (:func:`~megatron_mtraining.ops.fa4.varlen_reference`) against an
independent fp64 per-document reference, and the backend selection rules at every front door.

FA4 itself runs in the GPU test (tests/kernels/test_gpu_packed.py, ``fa4-varlen`` cases).
"""
import dataclasses
import functools
from types import SimpleNamespace

import pytest
import torch

import megatron_mtraining.ops.backends as backends
from megatron_mtraining.layout import Layout, PackedDocuments
from megatron_mtraining.ops.backends import kernel_backend_error, select_backend
from megatron_mtraining.ops.fa4 import (
    fa4_packed_causal,
    fa4_varlen_attention,
    flatten_thd,
    unflatten_lse,
    unflatten_thd,
    varlen_layout,
    varlen_layout_of,
    varlen_reference,
    varlen_token_index,
)
from megatron_mtraining.ring import dense_step_kernel, ring_attention
from tests.helpers.packed_ref import per_document_attention, rel_err

S = 64
# (cu_seqlens, cu_seqlens_padded, batch): THD offsets over the rows concatenated
DOCS = {
    "contiguous": ([0, 5, 6, 40, 64], None, 1),                        # no padding: a view
    "padded-tail": ([0, 10, 11, 30, 47], [0, 16, 17, 40, 57], 1),      # padded slots, then a tail
    "two-rows": ([0, 20, 20, 33, 53, 60], [0, 24, 30, 64, 84, 100], 2),  # an empty document, both rows padded
    "two-rows-dense": ([0, 64, 100, 128], None, 2),
}


def _docs(name):
    cu, pad, b = DOCS[name]
    return PackedDocuments.from_cu_seqlens(torch.tensor(cu), S, batch_size=b,
                                           cu_seqlens_padded=None if pad is None else torch.tensor(pad))


def _qkv(b, hq=4, hkv=2, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(b, S, h, d, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv), mk(hq)


def _lse_reference(q, k, cu, pad, scale):
    """fp64 LSE ``[b, hq, S]`` of every document alone, ``-inf`` elsewhere (independent of the glue)."""
    b, s, hq, d = q.shape
    rep = hq // k.shape[2]
    qf, kf = q.double().reshape(b * s, hq, d), k.double().reshape(b * s, -1, d).repeat_interleave(rep, 1)
    lse = torch.full((hq, b * s), float("-inf"), dtype=torch.float64)
    pad = cu if pad is None else pad
    for i in range(len(cu) - 1):
        n, a = cu[i + 1] - cu[i], pad[i]
        if n:
            sc = torch.einsum("qhd,khd->hqk", qf[a:a + n], kf[a:a + n]) * scale
            sc = sc.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            lse[:, a:a + n] = torch.logsumexp(sc, -1)
    return lse.view(hq, b, s).transpose(0, 1)


# ----------------------------------------------------------------------------- THD layout (pure)
def test_varlen_layout_of_each_case():
    lay = varlen_layout([0, 5, 6, 40, 64], None, 64)
    assert lay.dense and lay.cu_seqlens == (0, 5, 6, 40, 64) and lay.starts == (0, 5, 6, 40) and lay.max_seqlen == 34
    lay = varlen_layout([0, 10, 11, 30, 47], [0, 16, 17, 40, 57], 64)
    assert not lay.dense and lay.cu_seqlens == (0, 10, 11, 30, 47) and lay.starts == (0, 16, 17, 40)
    # b = 2: the offsets run over both rows (row 1 starts at flat 64); the empty document is left out
    lay = varlen_layout_of(_docs("two-rows"))
    assert (lay.batch_size, lay.seq_len, lay.total) == (2, 64, 60)
    assert lay.cu_seqlens == (0, 20, 33, 53, 60) and lay.starts == (0, 30, 64, 84) and lay.max_seqlen == 20
    idx = varlen_token_index(lay).tolist()
    assert idx == list(range(0, 20)) + list(range(30, 43)) + list(range(64, 84)) + list(range(84, 91))
    assert varlen_layout([0], None, 8).total == 0 and varlen_token_index(varlen_layout([0], None, 8)).numel() == 0
    with pytest.raises(ValueError, match="cu_seqlens_padded has 3 entries"):
        varlen_layout([0, 4], [0, 4, 8], 8)


@pytest.mark.parametrize("name", sorted(DOCS))
def test_flatten_and_unflatten_are_inverse_on_real_tokens(name):
    docs = _docs(name)
    lay = varlen_layout_of(docs)
    x = torch.randn(docs.batch_size, S, 3, 4, dtype=torch.float64)
    t = flatten_thd(x, lay)
    assert t.shape == (lay.total, 3, 4)
    real = docs.real()
    assert torch.equal(t, x[real])                                   # THD order = flat order of real tokens
    if lay.dense:
        assert t.data_ptr() == x.data_ptr()                          # a view, no copy
    back = unflatten_thd(t, lay)
    assert torch.equal(back[real], x[real]) and bool((back[~real] == 0).all())
    lse = torch.randn(3, lay.total, dtype=torch.float32)
    full = unflatten_lse(lse, lay)
    assert full.shape == (docs.batch_size, 3, S)
    assert torch.equal(full.transpose(1, 2)[real], lse.t()) and bool(torch.isneginf(full.transpose(1, 2)[~real]).all())
    with pytest.raises(ValueError, match="packed streams"):
        flatten_thd(x[:, :-1], lay)


# ----------------------------------------------------------------------------- glue against fp64
def _run(fn, q, k, v, do, docs, scale, **kw):
    xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = fa4_varlen_attention(*xs, docs, softmax_scale=scale, return_lse=True, varlen_fn=fn, **kw)
    out.backward(do)
    return out.detach(), lse, *(x.grad for x in xs)


@pytest.mark.parametrize("name", sorted(DOCS))
def test_varlen_glue_matches_per_document_fp64(name):
    """out, LSE, dQ, dK, dV of the glue (flatten, varlen call with cu_seqlens, unflatten) with the
    torch stand-in, GQA 4/2, fp64: equal to every document attended alone; padding exact zeros."""
    cu, pad, b = DOCS[name]
    docs = _docs(name)
    q, k, v, do = _qkv(b, seed=len(name))
    scale = 0.3
    seen = {}

    def spy(*a, **kw):
        seen.update(kw)
        return varlen_reference(*a, **kw)

    out, lse, dq, dk, dv = _run(spy, q, k, v, do, docs, scale)
    lay = varlen_layout_of(docs)
    assert seen["cu_seqlens_q"].dtype == torch.int32 and seen["cu_seqlens_q"].tolist() == list(lay.cu_seqlens)
    assert seen["max_seqlen_q"] == seen["max_seqlen_k"] == lay.max_seqlen and seen["causal"] is True
    want = per_document_attention(q, k, v, do, cu, scale, pad)
    for label, got, ref in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), want):
        assert rel_err(got, ref) <= 1e-12, label
    ref_lse = _lse_reference(q, k, cu, pad, scale)
    real = docs.real()
    assert rel_err(lse.transpose(1, 2)[real], ref_lse.transpose(1, 2)[real]) <= 1e-12
    assert bool(torch.isneginf(lse.transpose(1, 2)[~real]).all())
    for t in (out, dq, dk, dv):
        assert bool((t[~real] == 0).all()) and not bool(torch.isnan(t).any())


def test_varlen_glue_negative_controls(monkeypatch):
    """The checks see a varlen call that mixes documents, and a THD index that ignores the padding
    (the second row's documents read from the wrong flat positions)."""
    import megatron_mtraining.ops.fa4 as fa4

    cu, pad, b = DOCS["two-rows"]
    q, k, v, do = _qkv(b, seed=3)
    want = per_document_attention(q, k, v, do, cu, 0.3, pad)

    def one_sequence(qt, kt, vt, *, cu_seqlens_q, cu_seqlens_k, **kw):
        whole = torch.tensor([0, qt.shape[0]], dtype=torch.int32)
        return varlen_reference(qt, kt, vt, cu_seqlens_q=whole, cu_seqlens_k=whole, **kw)

    assert rel_err(_run(one_sequence, q, k, v, do, _docs("two-rows"), 0.3)[0], want[0]) > 1e-2
    monkeypatch.setattr(fa4, "varlen_token_index", lambda lay, device=None: torch.arange(lay.total))
    got = _run(varlen_reference, q, k, v, do, _docs("two-rows"), 0.3)      # new documents: not cached
    assert rel_err(got[0], want[0]) > 1e-2


def test_all_padding_gives_zeros_and_zero_gradients():
    docs = PackedDocuments.from_cu_seqlens(torch.tensor([0, 0]), S, cu_seqlens_padded=torch.tensor([0, 16]))
    q, k, v, do = _qkv(1)
    out, lse, dq, dk, dv = _run(varlen_reference, q, k, v, do, docs, 0.3)
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all()) and bool((dq == 0).all())
    assert dk is None or bool((dk == 0).all())


def test_ring_attention_runs_the_backend_varlen_function_at_cp1():
    """ring_attention with documents takes the backend's ``packed_cp1`` at CP=1 (here FA4's glue with the
    torch stand-in), equal to the torch ring; the ring steps of such a backend keep a document mask."""
    cu, pad, b = DOCS["padded-tail"]
    docs = _docs("padded-tail")
    q, k, v, do = _qkv(b, seed=5)
    torch_b = select_backend("torch", device="cpu", dtype=torch.float64, head_dim=8, packed=True)
    calls = []

    def counted(*a, **kw):
        calls.append(1)
        return fa4_packed_causal(*a, varlen_fn=varlen_reference, **kw)

    fake = dataclasses.replace(torch_b, name="fake-fa4", packed_cp1=counted)   # "fa4" checks Triton limits
    lay = Layout("striped", 1, 64)
    outs = []
    for bk in (fake, torch_b):
        xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = ring_attention(*xs, layout=lay, documents=docs, backend=bk, softmax_scale=0.3)
        out.backward(do)
        outs.append((out.detach(), *(x.grad for x in xs)))
    assert len(calls) == 1
    for got, ref in zip(*outs):
        assert rel_err(got, ref) <= 1e-12
    assert dense_step_kernel(fake, lay, 0, S, 0.3, True, "cpu", docs) is not None     # Triton/torch steps kept
    with pytest.raises(ValueError, match="has none"):
        dense_step_kernel(dataclasses.replace(fake, packed_cp1=None), lay, 0, S, 0.3, True, "cpu", docs)


# ----------------------------------------------------------------------------- selection rules
CUDA = dict(device="cuda", dtype=torch.bfloat16, head_dim=128, seq_len_local=8192, triton_available=True)


def test_auto_picks_fa4_varlen_for_packed_dense_attention_at_cp1_only():
    from megatron_mtraining.ops.dense_gpu import DenseGpuStepKernel

    b = select_backend("auto", packed=True, fa4_available=True, **CUDA)
    assert b.name == "fa4" and b.packed_cp1.func is fa4_packed_causal
    assert b.packed_cp1.keywords["deterministic"] is True and b.dense_cp1 is not None
    assert b.dense_step.func is DenseGpuStepKernel                   # ring steps: Triton, with the document mask
    nd = select_backend("auto", packed=True, fa4_available=True, deterministic=False, **CUDA)
    assert nd.packed_cp1.keywords["deterministic"] is False
    for kw in (dict(cp_size=2), dict(sparse=True), dict(cp_size=4, sparse=True)):
        other = select_backend("auto", packed=True, fa4_available=True, **CUDA, **kw)
        assert other.name == "triton" and other.packed_cp1 is None, kw
    assert select_backend("auto", packed=True, fa4_available=False, **CUDA).name == "triton"
    plain = select_backend("auto", packed=False, fa4_available=True, **CUDA)   # unpacked: unchanged
    assert plain.name == "fa4" and plain.packed_cp1 is None and plain.dense_step.func.__name__ == "make_fa4_dense_step"


def test_explicit_fa4_with_packed_documents():
    b = select_backend("fa4", packed=True, fa4_available=True, **CUDA)
    assert b.name == "fa4" and b.packed_cp1 is not None
    with pytest.raises(ValueError, match=r"cannot run packed sequences \(document masks\) at cp_size 2: .*varlen"):
        select_backend("fa4", packed=True, fa4_available=True, cp_size=2, **CUDA)
    with pytest.raises(ValueError, match="cannot run packed sequences .* with the vertical-slash pattern"):
        select_backend("fa4", packed=True, sparse=True, fa4_available=True, **CUDA)
    with pytest.raises(ValueError, match="kernel_backend='sdpa' cannot run packed sequences"):
        select_backend("sdpa", packed=True, fa4_available=True, **CUDA)


def test_self_check_for_packed_runs_the_varlen_check(monkeypatch):
    import megatron_mtraining.ops.fa4 as fa4

    asked = []
    monkeypatch.setattr(backends, "_fa4_problem", lambda *a: None)
    monkeypatch.setattr(fa4, "fa4_varlen_self_check", lambda *a, **kw: asked.append(("varlen", kw)) or "broken")
    monkeypatch.setattr(fa4, "fa4_self_check", lambda *a, **kw: asked.append(("steps", kw)))
    with pytest.warns(RuntimeWarning, match="broken; using the Triton kernels instead"):
        b = select_backend("auto", packed=True, deterministic=False, **CUDA)
    assert b.name == "triton" and asked == [("varlen", {"hq": 4, "hkv": 2, "deterministic": False})]
    with pytest.warns(RuntimeWarning, match="broken"):           # explicit 'fa4': the Triton steps too
        assert select_backend("fa4", packed=True, **CUDA).name == "triton"
    asked.clear()
    assert select_backend("auto", packed=False, **CUDA).name == "fa4" and asked[0][0] == "steps"


def test_backend_capabilities():
    """What the ring and the plan ask of a backend (instead of its name), for each kind of backend."""
    def caps(b):
        return b.name, b.triton_steps, b.document_steps, b.sparse_documents, b.group_indices

    assert caps(select_backend("auto", packed=False, fa4_available=True, **CUDA)) == ("fa4", True, False, False, False)
    assert caps(select_backend("auto", packed=True, fa4_available=True, **CUDA)) == ("fa4", True, True, False, False)
    assert caps(select_backend("auto", packed=True, fa4_available=True, sparse=True, **CUDA)) == \
        ("triton", True, True, True, True)
    assert caps(select_backend("sdpa", **{**CUDA, "triton_available": False})) == ("sdpa", False, False, False, False)
    assert caps(select_backend("torch", device="cpu", dtype=torch.float32, head_dim=64)) == \
        ("torch", False, True, True, False)


def test_front_doors_agree(monkeypatch):
    """kernel_backend_error (and the command line's kernel_backend_problem) accept 'fa4' with packed
    documents at CP=1 and refuse it at CP>1 and with the sparse pattern, as select_backend does."""
    from megatron_mtraining.config import load_mtraining_config
    from megatron_mtraining.plan import kernel_backend_problem

    kw = dict(device="cuda", dtype=torch.bfloat16, head_dim=128, seq_len_local=4096)
    # this machine has no CUDA: FA4 and Triton are refused for the device first
    assert "needs a CUDA device" in kernel_backend_error("fa4", cp_size=1, sparse=False, packed=True, **kw)
    monkeypatch.setattr(backends, "_fa4_problem", lambda *a: None)
    monkeypatch.setattr(backends, "triton_runs_on", lambda device: True)
    assert kernel_backend_error("fa4", cp_size=1, sparse=False, packed=True, **kw) is None
    assert "at cp_size 2" in kernel_backend_error("fa4", cp_size=2, sparse=False, packed=True, **kw)
    assert "vertical-slash" in kernel_backend_error("fa4", cp_size=1, sparse=True, packed=True, **kw)
    assert kernel_backend_error("auto", cp_size=2, sparse=False, packed=True, **kw) is None
    cfg = load_mtraining_config({"kernel_backend": "fa4"})
    args = lambda cp: SimpleNamespace(context_parallel_size=cp, bf16=True, kv_channels=128, seq_length=8192,  # noqa
                                      num_attention_heads=8, hidden_size=1024, reset_attention_mask=True,
                                      mtraining_config="x.yaml")
    assert kernel_backend_problem(args(1), cfg, cuda=True) is None
    assert "at cp_size 2" in kernel_backend_problem(args(2), cfg, cuda=True)


def test_kernel_summary_names_the_varlen_function():
    from megatron_mtraining.plan import resolve

    plan = resolve({"kernel_backend": "fa4"}, cp_group=None)
    b = select_backend("fa4", packed=True, fa4_available=True, **CUDA)
    plan._backends[("cuda", None, torch.bfloat16, 128, 8192, True, False)] = b
    assert plan.kernel_summary() == "dense: fa4 (CP=1 fa4_packed_causal)"      # the partial's function


@pytest.mark.parametrize("check", ["steps", "varlen"])
def test_self_checks_run_with_autograd_under_no_grad(monkeypatch, check):
    """A layer's first call may come under torch.no_grad (full recomputation's first forward): the self-check
    must still run its backward there, else its failure is cached and FA4 is never used."""
    import megatron_mtraining.ops.fa4 as fa4

    seen = []
    name = "_self_check_cached" if check == "steps" else "_varlen_self_check_cached"
    monkeypatch.setattr(fa4, "fa4_unavailable_reason", lambda *a: None)
    monkeypatch.setattr(fa4, name, lambda *a: seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cuda"),
                                                           torch.is_inference_mode_enabled())))
    fn = fa4.fa4_self_check if check == "steps" else functools.partial(fa4.fa4_varlen_self_check, deterministic=True)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        fn("cuda:0", torch.bfloat16, 128, hq=4, hkv=2)
        assert not torch.is_grad_enabled()                      # the caller's mode is restored
    with torch.inference_mode():
        fn("cuda:0", torch.bfloat16, 128, hq=4, hkv=2)
        assert torch.is_inference_mode_enabled()
    assert seen == [(True, False, False)] * 2
