"""What one attention layer keeps for its backward: live tensors after the forward, dense against sparse.

Runs one layer (``CPPlan.fixed_attention_runner`` of configs/long_context_r098.yaml; dense: the same config with
the layer in ``dense_layers``) on ``[1, S, 9, 64]`` queries and ``[1, S, 3, 64]`` keys/values (the SmolLM2-135M
attention shape, ``tools/bench_layer.py``'s random inputs with a sink: patterns at the caps), twice per mode, and
prints the memory allocated by the forward and still held (its output and what autograd and the kernels keep for the
backward), the new live tensors grouped by shape and dtype, and the tensors autograd saved.

    python docs/results/raw/graphs_shared_buffers/layer_memory.py 131072 random
"""
import collections
import gc
import sys

import torch

sys.path.insert(0, "tools")
from bench_layer import layer_inputs  # noqa: E402

from megatron_mtraining.config import load_mtraining_config  # noqa: E402
from megatron_mtraining.plan import resolve  # noqa: E402
S = int(sys.argv[1]); kind = sys.argv[2] if len(sys.argv) > 2 else "random"
cfg = load_mtraining_config("configs/long_context_r098.yaml")
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu"); sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None); mem = torch.cuda.memory_allocated if dev.type == "cuda" else (lambda: 0)
q, k, v = layer_inputs(S, 9, 3, 64, kind, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
def live():
    out = {}
    for o in gc.get_objects():
        try:
            if torch.is_tensor(o) and o.device.type == dev.type and not o._is_view():
                out[id(o)] = o
        except Exception:
            pass
    return out
for mode in ("dense", "sparse"):
    c = cfg.with_dense_layers([1]) if mode == "dense" else cfg
    run = resolve(c, cp_group=None, seq_len=S).for_layer(1).fixed_attention_runner()
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    for it in range(2):
        gc.collect(); sync()
        before = live(); m0 = mem()
        saved = []
        def pack(t):
            saved.append((tuple(t.shape), str(t.dtype), t.numel() * t.element_size(), t.data_ptr()))
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run(qq, kk, vv, softmax_scale=64 ** -0.5)
        sync(); gc.collect()
        m1 = mem()
        after = live()
        new = [t for i, t in after.items() if i not in before]
        agg = collections.Counter(); cnt = collections.Counter()
        for t in new:
            key = (tuple(t.shape), str(t.dtype)); agg[key] += t.untyped_storage().nbytes(); cnt[key] += 1
        print(f"== {mode} it{it} S={S}: retained after forward {(m1-m0)/2**20:.1f} MiB (out {out.numel()*out.element_size()/2**20:.1f} MiB)")
        for key, b in agg.most_common(25):
            print(f"   {b/2**20:9.1f} MiB  x{cnt[key]}  {key}")
        print("   saved:", [(s, d, round(b/2**20, 1)) for s, d, b, p in saved])
        torch.autograd.grad(out, (qq, kk, vv), torch.randn_like(out))
        del out
