"""CUDA graphs of a sparse layer's attention (``cuda_graphs: true``; marker ``gpu``, skipped without CUDA).

The invariant: a replay computes what the eager call computes on the same inputs (the same kernels), so with
``deterministic: true`` out, dQ, dK and dV are bitwise equal to the eager call's, for several input draws
through one captured graph (the pattern is re-estimated on every replay: a stale replay would give the first
draw's pattern, which the negative control below tells apart). The eager path itself is checked against fp64
in test_gpu_kernels.py and tests/distributed/test_sparse_ring.py. Also: no-grad calls run eagerly, a second
forward in flight is refused, and the gradients handed out are copies (a leaf's .grad survives the next call).
"""

from __future__ import annotations

import pytest
import torch

from megatron_mtraining.plan import resolve

pytestmark = pytest.mark.gpu

B, S, HQ, HKV, D = 1, 4096, 9, 3, 64          # the SmolLM2-135M attention shape at 4K
SCALE = D ** -0.5


def _plan(deterministic: bool):
    cfg = {"pattern": "vertical_slash", "deterministic": deterministic, "cuda_graphs": True,
           "vertical_slash": {"recall": 0.9, "max_vertical": 512, "max_slash": 16}}
    return resolve(cfg, cp_group=None, seq_len=S).for_layer(1)


def _inputs(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(B, S, h, D, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    q, k, v, do = mk(HQ), mk(HKV), mk(HKV), mk(HQ)
    k[:, :64] *= 4                                   # a sink: a pattern with columns and diagonals
    return [t.requires_grad_(True) for t in (q, k, v)], do


def _run(fn, seed: int):
    (q, k, v), do = _inputs(seed)
    out = fn(q, k, v, softmax_scale=SCALE)
    out.backward(do)
    return out.detach().clone(), q.grad, k.grad, v.grad     # a copy: the model keeps no handed-out output


def _entries(runner):
    return [e for g in runner.graphs.values() for e in g._entries.values()]


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fast"])
def test_replays_equal_the_eager_call(deterministic):
    plan = _plan(deterministic)
    runner = plan.attention_runner()
    outs = []
    for seed in (0, 1, 2):
        eager = _run(plan.attention, seed)
        graphed = _run(runner, seed)
        assert torch.equal(graphed[0], eager[0]), f"seed {seed}: out"   # the forward has no atomics
        for name, g, e in zip(("dQ", "dK", "dV"), graphed[1:], eager[1:]):
            assert torch.isfinite(g).all(), name
            if deterministic:
                assert torch.equal(g, e), f"seed {seed}: {name} differs from the eager call"
            else:   # fast mode: atomics (where the launch parameters enable them) may sum in another order:
                    # within 2 bf16 ulps of the largest gradient
                err = float((g.float() - e.float()).abs().max() / e.float().abs().max())
                assert err <= 2 ** -7, f"seed {seed}: {name} {err:.2e}"
        outs.append(graphed[0])
    assert sum(g.captured for g in runner.graphs.values()) == 1           # one signature, one capture
    (entry,) = _entries(runner)
    assert entry.generation == 3 and not entry.copy_out      # three replays, each handing out the output buffer
    # negative control: a replay that reused the first draw's pattern or output would match seed 0
    assert not torch.equal(outs[1], outs[0]) and not torch.equal(outs[2], outs[1])


def test_no_grad_runs_eagerly_and_a_second_forward_in_flight_is_refused():
    plan = _plan(True)
    runner = plan.attention_runner()
    (q, k, v), do = _inputs(3)
    with torch.no_grad():
        ref = plan.attention(q, k, v, softmax_scale=SCALE)
        assert torch.equal(runner(q, k, v, softmax_scale=SCALE), ref)
    assert not runner.graphs or all(g.captured == 0 for g in runner.graphs.values())
    out = runner(q, k, v, softmax_scale=SCALE)
    with pytest.raises(RuntimeError, match="second forward of this layer before the backward"):
        runner(q, k, v, softmax_scale=SCALE)
    del out                                            # its autograd graph is gone: the layer is free again
    out = runner(q, k, v, softmax_scale=SCALE)
    out.backward(do)
    first, first_out = q.grad.clone(), out.detach().clone()
    q.grad = None
    (q2, k2, v2), do2 = _inputs(4)
    with pytest.warns(RuntimeWarning, match="still referenced past its backward"):
        o2 = runner(q2, k2, v2, softmax_scale=SCALE)          # `out` is still referenced: this call runs eagerly
    o2.backward(do2)
    del o2
    assert torch.equal(out, first_out)                # ...and leaves the kept output as it was
    (entry,) = _entries(runner)
    assert entry.copy_out
    del out
    out = runner(q, k, v, softmax_scale=SCALE)
    out.backward(do)
    assert torch.equal(q.grad, first)                 # the same inputs again: the same gradient...
    kept = q.grad
    runner(q2, k2, v2, softmax_scale=SCALE).backward(do2)
    assert torch.equal(kept, first)                   # ...and a copy, not the graph's buffer


def _two_layers(fns, seed):
    """Two attention layers in training order (forwards 1, 2, then the backward through both); returns out, dQ,
    dK, dV of the inputs. As in training, the model keeps no layer output past the backward (one kept is
    covered below and in tests/unit/test_graph_rules.py)."""
    (q, k, v), do = _inputs(seed)
    h = fns[0](q, k, v, softmax_scale=SCALE)
    # k and v reach both layers: their gradients add up the two layers' (shared) gradient buffers' copies
    k2, v2 = h[:, :, :HKV] + k, h[:, :, HKV:2 * HKV] + v
    out = fns[1](h, k2, v2, softmax_scale=SCALE)
    kept = out.detach().clone()
    loss = (out.float() * do.float()).sum()       # d loss / d out = do; as in training, nothing keeps out
    del out, h
    loss.backward()
    return kept, q.grad, k.grad, v.grad


def test_layers_share_the_pool_in_training_order():
    """Two layers: forwards 1, 2 then one backward through both equals the eager model bitwise (the shared pool
    keeps each forward's saved tensors while the other layer runs, and the layers share the backward's static
    buffers); a layer captured earlier may not run while a later one awaits its backward."""
    plan = resolve({"pattern": "vertical_slash", "deterministic": True, "cuda_graphs": True,
                    "vertical_slash": {"recall": 0.9, "max_vertical": 512, "max_slash": 16}}, cp_group=None, seq_len=S)
    layers = [plan.for_layer(1), plan.for_layer(2)]
    runners = [p.attention_runner() for p in layers]
    model = _two_layers

    for seed in (5, 6):
        eager = model([p.attention for p in layers], seed)
        graphed = model(runners, seed)
        for name, g, e in zip(("out", "dQ", "dK", "dV"), graphed, eager):
            assert torch.equal(g, e), f"seed {seed}: {name}"
    # both layers have one input signature: their backwards replay through one set of static buffers
    (e1,), (e2,) = (_entries(r) for r in runners)
    assert e1.grads is e2.grads and e1.grad_out is e2.grad_out
    assert not e1.copy_out and not e2.copy_out and e1.generation == e2.generation == 2     # replays, not eager
    (q, k, v), _ = _inputs(7)
    pending = runners[1](q, k, v, softmax_scale=SCALE)           # layer 2 (captured second) awaits its backward
    with pytest.raises(RuntimeError, match="awaits its backward"):
        runners[0](q, k, v, softmax_scale=SCALE)
    del pending
    runners[0](q, k, v, softmax_scale=SCALE)                     # free again
    # layer 2's output kept past the backward keeps its values, though layer 1's backward replay may write where
    # layer 2's capture placed it (warned; layer 2 hands out copies from then on)
    (q, k, v), do = _inputs(8)
    h = runners[0](q, k, v, softmax_scale=SCALE)
    out = runners[1](h, h[:, :, :HKV] + k, h[:, :, HKV:2 * HKV] + v, softmax_scale=SCALE)
    before = out.detach().clone()
    with pytest.warns(RuntimeWarning, match="still referenced past its backward"):
        out.backward(do)
    assert torch.equal(out, before) and e2.copy_out


def test_a_kept_output_survives_the_replays_of_a_layer_captured_before_it(monkeypatch):
    """Real CUDA graphs in one fresh pool: layer 1's capture frees transients of the output's size (its forward's
    intermediate, its backward's gradients), and layer 2's capture, a single op (q + k * v / 2), places its output in
    one of them, so layer 1's replays (the backward after layer 2's, the next step's forward) write there. Kept past
    the backward, layer 2's output keeps its values (warned). Negative control: the same replays without the save and
    restore change it."""
    from megatron_mtraining.ring import graphs

    def layer1(q, k, v):
        t = q * 3.0 + k.sum() * v.sum()          # freed when the function returns (nothing saves it)
        return t * 0.5

    def layer2(q, k, v):
        return torch.addcmul(q, k, v, value=0.5)  # one op; k and v take part, as the capture's gradient asks

    def run():
        monkeypatch.setattr(graphs, "_POOLS", {})
        l1, l2 = graphs.CUDAGraphedAttention(layer1), graphs.CUDAGraphedAttention(layer2)
        mk = lambda s: [torch.randn(2, 256, 4, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(s))  # noqa: E731
                        .requires_grad_(True) for _ in range(3)]
        q, k, v = mk(0)
        l2(l1(q, k, v), k, v).sum().backward()          # both captured, nothing kept
        q, k, v = mk(1)
        out = l2(l1(q, k, v), k, v)
        before = out.detach().clone()
        out.sum().backward()                            # layer 1's backward replay
        l1(*mk(2)).sum().backward()                     # the next step's layer-1 forward and backward replays
        torch.cuda.synchronize()
        return torch.equal(out, before), l2

    with pytest.warns(RuntimeWarning, match="still referenced past its backward"):
        same, l2 = run()
    assert same and next(iter(l2._entries.values())).copy_out
    monkeypatch.setattr(graphs._Pool, "replay", lambda self, entry, graph: graph.replay())
    assert not run()[0], "negative control: layer 1's replays did not reach layer 2's output buffer"


def test_a_second_backward_through_one_forward_is_refused():
    """A retained graph's second backward would read saved tensors that other layers' replays may have
    overwritten: refused by name, as is a second backward after the first freed the graph."""
    plan = _plan(True)
    runner = plan.attention_runner()
    (q, k, v), do = _inputs(8)
    out = runner(q, k, v, softmax_scale=SCALE)
    out.backward(do, retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through one forward"):
        out.backward(do)


def _fa4_missing() -> bool:
    from megatron_mtraining.ops.fa4 import fa4_unavailable_reason
    return not torch.cuda.is_available() or fa4_unavailable_reason("cuda", torch.bfloat16, D) is not None


@pytest.mark.skipif(_fa4_missing(), reason="needs flash-attn-4 on a Hopper or Blackwell GPU")
def test_fa4_sparse_layers_replay_what_the_eager_model_computes(monkeypatch):
    """FlashAttention-4 slash blocks (128-token blocks, kernel_backend fa4, fast mode) through two layers in training
    order replay graphs: out, dQ, dK and dV match the eager model within FA4's atomic summation order (2 bf16 ulps
    of the largest gradient). With ``FA4SparseStepKernel.capture`` off their capture is refused by name and the
    layers run eagerly (a warning). Negative control: a step kernel that frees its forward's block lists in
    ``end_backward`` lets the next layer's capture take their memory, so layer 1's backward replays read other
    lists (gradients off by far more)."""
    from megatron_mtraining.ops.fa4 import FA4SparseStepKernel
    from megatron_mtraining.ring import graphs

    def run(expect_replays: bool):
        monkeypatch.setattr(graphs, "_POOLS", {})     # a fresh pool: layer 2's capture meets layer 1's freed blocks
        plan = resolve({"pattern": "vertical_slash", "deterministic": False, "cuda_graphs": True,
                        "kernel_backend": "fa4", "granularity": 128,
                        "vertical_slash": {"recall": 0.9, "block_size": 128, "max_vertical": 512, "max_slash": 8}},
                       cp_group=None, seq_len=S)
        layers = [plan.for_layer(1), plan.for_layer(2)]
        runners = [p.attention_runner() for p in layers]
        errs = []
        for seed in (9, 10):
            eager = _two_layers([p.attention for p in layers], seed)
            graphed = _two_layers(runners, seed)
            errs.append(max(float((g.float() - e.float()).abs().max() / e.float().abs().max())
                            for g, e in zip(graphed, eager)))
        entries = [e for r in runners for g in r.graphs.values() for e in g._entries.values()]
        if expect_replays:
            assert len(entries) == 2 and all(e is not None and e.generation == 2 for e in entries)
        else:
            assert entries and all(e is None for e in entries)        # the capture failed: eager
        return max(errs)

    assert run(expect_replays=True) <= 2 ** -7
    monkeypatch.setattr(FA4SparseStepKernel, "capture", False)
    with pytest.warns(RuntimeWarning, match="set not to be captured in CUDA graphs"):
        assert run(expect_replays=False) <= 2 ** -7
    monkeypatch.setattr(FA4SparseStepKernel, "capture", True)
    keep = FA4SparseStepKernel.end_backward

    def end_backward_freeing_the_lists(self):
        keep(self)
        self._cache.clear()
    monkeypatch.setattr(FA4SparseStepKernel, "end_backward", end_backward_freeing_the_lists)
    assert run(expect_replays=True) > 2 ** -4, "negative control: freeing the lists went unnoticed"
