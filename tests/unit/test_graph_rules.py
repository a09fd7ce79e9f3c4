"""The bookkeeping of megatron_mtraining/ring/graphs.py on the CPU: the replay Function and the shared pool's
order rule, with stand-in graphs whose replay reruns the captured function into the same static buffers (the
semantics of a CUDA graph replay). The real capture and replay on a GPU: tests/kernels/test_gpu_graphs.py."""
from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch

from megatron_mtraining.ring import graphs as G


class _StandInGraph:
    def __init__(self, replay):
        self._replay = replay

    def replay(self):
        self._replay()


class _CPUGraphed(G.CUDAGraphedAttention):
    """Captures into stand-in graphs: forward replay writes fn(static inputs) into the static output, backward
    replay writes its gradients into the static gradient buffers."""

    def __init__(self, fn, pool):
        super().__init__(fn)
        self.pool = pool

    def _capture(self, q, k, v):
        entry = G._Entry(self.pool)
        entry.inputs = tuple(t.detach().clone().requires_grad_(True) for t in (q, k, v))
        entry.out_data = torch.zeros_like(q)
        (entry.grad_out,) = self.pool.shared_like("grad_out", entry.out_data)
        entry.grads = self.pool.shared_like("grads", *entry.inputs)
        live = {}

        def fwd():
            with torch.enable_grad():
                live["out"] = self.fn(*entry.inputs)
            entry.out_data.copy_(live["out"].detach())

        def bwd():
            for buf, g in zip(entry.grads, torch.autograd.grad(live["out"], entry.inputs, entry.grad_out)):
                buf.copy_(g)

        entry.fwd, entry.bwd = _StandInGraph(fwd), _StandInGraph(bwd)
        self.pool.add(entry)
        return entry


class _SharingMemory(_CPUGraphed):
    """Stand-in graphs over one block of memory (``scratch``), as CUDA graphs in one pool share it: a layer built
    with ``output_there`` places its output buffer in it (a capture may take memory that an earlier capture freed),
    the others' replays write their transients there."""

    def __init__(self, fn, pool, scratch, output_there: bool):
        super().__init__(fn, pool)
        self.scratch, self.output_there = scratch, output_there

    def _capture(self, q, k, v):
        entry = super()._capture(q, k, v)
        if self.output_there:
            entry.out_data = self.scratch[:q.numel()].view_as(q)
        else:
            for graph in (entry.fwd, entry.bwd):
                graph._replay = (lambda run=graph._replay: (run(), self.scratch.fill_(float("nan"))))
        return entry


def _pool():
    p = G._Pool.__new__(G._Pool)
    p.handle, p.captured, p.in_flight, p.shared, p.holding = None, 0, [], {}, {}
    return p


def _attn(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2), -1) @ v


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 8, generator=g, dtype=torch.float64).requires_grad_(True) for _ in range(3)]


def _eager(q, k, v):
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ref = _attn(q2, k2, v2)
    ref.sum().backward()
    return ref, q2.grad, k2.grad, v2.grad


def _entry(layer):
    return next(iter(layer._entries.values()))


def test_replays_give_the_eager_values_and_the_output_buffer():
    """Each replay gives the eager output and gradients; the output handed out is the graph's output buffer (no
    copy: the eager call hands out the tensor it saves), the gradients are copies."""
    layer = _CPUGraphed(_attn, _pool())
    grads = []
    for seed in (0, 1, 2):
        q, k, v = _inputs(seed)
        out = layer(q, k, v)
        assert out.untyped_storage().data_ptr() == _entry(layer).out_data.untyped_storage().data_ptr()
        out.sum().backward()
        ref, gq, gk, gv = _eager(q, k, v)
        assert torch.equal(out, ref) and torch.equal(q.grad, gq) and torch.equal(k.grad, gk) and torch.equal(v.grad, gv)
        grads.append((q.grad, q.grad.clone()))
        del out                                    # the model drops the output after its backward
    assert all(torch.equal(g, kept) for g, kept in grads)        # gradients are copies
    assert layer.captured == 1 and not _entry(layer).copy_out


def test_an_output_kept_past_the_next_forward_is_not_overwritten(monkeypatch):
    """An output (or a view of it) still referenced at the layer's next forward: that forward runs eagerly and
    warns, the kept output keeps its values, and later replays hand out copies. Negative control: without the
    check the replay overwrites the kept output."""
    layer = _CPUGraphed(_attn, _pool())
    q, k, v = _inputs(0)
    out = layer(q, k, v)
    out.sum().backward()
    kept, view = out.detach().clone(), out.view(-1)[:5]
    del out
    buffer = _entry(layer).out_data.untyped_storage().data_ptr()
    for seed in (1, 2, 3, 4):
        q, k, v = _inputs(seed)
        if seed == 1:
            with pytest.warns(RuntimeWarning, match="still referenced past its backward"):
                out = layer(q, k, v)
        else:
            out = layer(q, k, v)
        assert out.untyped_storage().data_ptr() != buffer                 # eager while kept, then copies
        out.sum().backward()
        ref, gq, _, gv = _eager(q, k, v)
        assert torch.equal(out, ref) and torch.equal(q.grad, gq) and torch.equal(v.grad, gv)
        if seed < 3:
            assert torch.equal(view, kept.view(-1)[:5]), "a kept output was overwritten"
        if seed == 3:
            del view                               # released: the replays run again, handing out copies
            replays = _entry(layer).generation
        del out
    assert _entry(layer).copy_out and _entry(layer).generation == replays + 1

    monkeypatch.setattr(G._Entry, "output_kept", lambda self: False)    # negative control
    layer = _CPUGraphed(_attn, _pool())
    out = layer(*_inputs(0))
    out.sum().backward()
    kept = out.detach().clone()
    layer(*_inputs(1)).sum().backward()
    assert not torch.equal(out, kept)


def test_each_layer_that_keeps_an_output_warns_once_under_the_default_filter(monkeypatch):
    """Two layers whose outputs are kept past their backward: under Python's default filter (one message per text
    and place) each layer's warning shows once, naming its capture order. Negative control: one text for every
    layer shows a single warning."""
    def run():
        pool = _pool()
        layers = [_CPUGraphed(_attn, pool) for _ in range(2)]
        kept = []
        for layer in layers:
            out = layer(*_inputs(0))
            out.sum().backward()
            kept.append(out)                       # referenced past its backward
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("default")
            for seed in (1, 2):
                for layer in layers:
                    layer(*_inputs(seed)).sum().backward()
        return [str(w.message) for w in seen if "still referenced past its backward" in str(w.message)]

    shown = run()
    assert len(shown) == 2 and "[layer 1 in" in shown[0] and "[layer 2 in" in shown[1]

    def one_text(self):                            # negative control: the same text for every layer
        if not self.copy_out:
            warnings.warn(G.OUTPUT_KEPT_WARNING, RuntimeWarning, stacklevel=3)
            self.copy_out = True
    monkeypatch.setattr(G._Entry, "keep_copies", one_text)
    assert len(run()) == 1


def test_a_kept_storage_counts_and_saved_tensor_hooks_get_copies():
    """Only the storage of a handed-out output kept (no tensor): still kept, the next forward runs eagerly.
    Under saved-tensor hooks, which skip autograd's version check, the output handed out is a copy."""
    layer = _CPUGraphed(_attn, _pool())
    out = layer(*_inputs(0))
    out.sum().backward()
    st, kept, shape = out.untyped_storage(), out.detach().clone(), out.shape
    del out
    with pytest.warns(RuntimeWarning, match="still referenced past its backward"):
        layer(*_inputs(1)).sum().backward()
    assert torch.equal(torch.empty(0, dtype=kept.dtype).set_(st, 0, shape), kept)

    layer = _CPUGraphed(_attn, _pool())
    q, k, v = _inputs(2)
    with torch.autograd.graph.save_on_cpu():
        out = layer(q, k, v)
        assert out.untyped_storage().data_ptr() != _entry(layer).out_data.untyped_storage().data_ptr()
        out.sum().backward()
    assert torch.equal(out, _eager(q, k, v)[0]) and not _entry(layer).copy_out
    del out
    out = layer(q, k, v)                           # without hooks: the buffer again
    assert out.untyped_storage().data_ptr() == _entry(layer).out_data.untyped_storage().data_ptr()


def test_an_output_modified_in_place_is_refused_in_the_backward():
    """The output buffer handed out is saved for the backward as the eager call saves its output: an in-place
    change to it or a view of it makes the backward raise, never a gradient from the changed values."""
    layer = _CPUGraphed(_attn, _pool())
    for change in (lambda o: o.add_(1.0), lambda o: o.view(-1)[:3].mul_(2.0)):
        out = layer(*_inputs(0))
        change(out)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
        del out


def test_second_forward_and_second_backward_are_refused():
    layer = _CPUGraphed(_attn, _pool())
    q, k, v = _inputs(0)
    out = layer(q, k, v)
    with pytest.raises(RuntimeError, match="second forward of this layer before the backward"):
        layer(q, k, v)
    del out                                        # dropped without a backward: the layer is free
    out = layer(q, k, v)
    loss = out.sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through one forward"):
        loss.backward()
    with torch.no_grad():                          # no gradients: eager, whatever is in flight
        assert torch.equal(layer(q, k, v), _attn(q, k, v))


def test_replay_order_follows_the_capture_order():
    """Layers 1, 2 share a pool: forwards 1, 2 then backwards 2, 1 run; layer 1 while layer 2 (captured later)
    awaits its backward is refused, before anything runs."""
    pool = _pool()
    l1, l2 = _CPUGraphed(_attn, pool), _CPUGraphed(_attn, pool)
    q, k, v = _inputs(0)
    for _ in range(2):
        h = l1(q, k, v)
        l2(h, k, v).sum().backward()
        del h
    pending = l2(q, k, v)
    with pytest.raises(RuntimeError, match="awaits its backward"):
        l1(q, k, v)
    pending.sum().backward()
    del pending
    l1(q, k, v).sum().backward()                   # free again


def test_layers_of_one_signature_share_the_backward_buffers():
    """Two layers with the same input signature replay their backwards through one set of static buffers (the
    incoming gradient and the gradients handed out); a model of both still gets the eager gradients, and another
    signature gets its own set."""
    pool = _pool()
    l1, l2 = _CPUGraphed(_attn, pool), _CPUGraphed(_attn, pool)
    for seed in (0, 1):
        q, k, v = _inputs(seed)
        l2(l1(q, k, v), k, v).square().sum().backward()
        q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        _attn(_attn(q2, k2, v2), k2, v2).square().sum().backward()
        for g, ref in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
            assert torch.allclose(g, ref, rtol=1e-12, atol=0), "a layer's gradients were overwritten"
    e1, e2 = (next(iter(layer._entries.values())) for layer in (l1, l2))
    assert e1.grads is e2.grads and e1.grad_out is e2.grad_out and len(pool.shared) == 2
    wide = [torch.randn(4, 16, dtype=torch.float64).requires_grad_(True) for _ in range(3)]
    l3 = _CPUGraphed(_attn, pool)
    l3(*wide).sum().backward()
    assert next(iter(l3._entries.values())).grads is not e1.grads and len(pool.shared) == 4


def test_an_output_kept_past_its_backward_survives_the_replays_of_the_layers_before_it(monkeypatch):
    """Layer 2's output buffer sits where layer 1's replays write their transients (the shared pool allows it: an
    output that the model drops after its backward is never read again). Kept past the backward, the output keeps
    its values through layer 1's backward replay and the next step's layer-1 forward replay, with a warning; layer 2
    then hands out copies. Negative control: replays without the save and restore leave NaN in the kept output."""
    def model(pool):
        scratch = torch.zeros(64, dtype=torch.float64)
        l1, l2 = _SharingMemory(_attn, pool, scratch, False), _SharingMemory(_attn, pool, scratch, True)
        q, k, v = _inputs(0)
        l2(l1(q, k, v), k, v).sum().backward()           # both captured; nothing kept
        return l1, l2

    def eager(q, k, v):
        with torch.no_grad():
            return _attn(_attn(q, k, v), k, v)

    l1, l2 = model(_pool())
    q, k, v = _inputs(1)
    out = l2(l1(q, k, v), k, v)
    assert out.untyped_storage().data_ptr() == _entry(l2).out_data.untyped_storage().data_ptr()
    with pytest.warns(RuntimeWarning, match="still referenced past its backward"):
        out.sum().backward()                              # layer 1's backward replay writes the scratch
    ref = eager(q, k, v)
    assert torch.equal(out, ref) and _entry(l2).copy_out
    q2, k2, v2 = _inputs(2)
    h = l1(q2, k2, v2)                                    # the next step's layer-1 forward replay
    assert torch.equal(out, ref)
    out2 = l2(h, k2, v2)                                  # layer 2 runs eagerly while its output is kept
    assert out2.untyped_storage().data_ptr() != _entry(l2).out_data.untyped_storage().data_ptr()
    out2.sum().backward()
    assert torch.equal(out, ref) and torch.equal(out2, eager(q2, k2, v2))

    # layer 2 dropped while the model keeps (a detached view of) its output: the pool still keeps it intact
    l1, l2 = model(_pool())
    q, k, v = _inputs(3)
    out = l2(l1(q, k, v), k, v)
    with pytest.warns(RuntimeWarning, match="still referenced past its backward"):
        out.sum().backward()
    kept, entry2 = out.detach(), weakref.ref(_entry(l2))
    del out, l2
    gc.collect()
    assert entry2() is not None                   # held by the pool while its output is referenced
    l1(*_inputs(4)).sum().backward()
    assert torch.equal(kept, eager(q, k, v))
    del kept
    l1(*_inputs(5)).sum().backward()              # released: the pool lets go of layer 2's graphs
    gc.collect()
    assert entry2() is None

    monkeypatch.setattr(G._Pool, "replay", lambda self, entry, graph: graph.replay())    # negative control
    l1, l2 = model(_pool())
    q, k, v = _inputs(1)
    out = l2(l1(q, k, v), k, v)
    out.sum().backward()
    assert torch.isnan(out).all()
