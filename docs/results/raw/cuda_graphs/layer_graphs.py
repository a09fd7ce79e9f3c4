"""Per-layer attention fwd+bwd: sparse eager vs sparse CUDA graphs vs dense (auto), SmolLM2 shape."""
import json, sys, time
import torch
from megatron_mtraining.plan import resolve
from megatron_mtraining.bench import compare_speed
from megatron_mtraining.bench.speed import time_forward_backward

base = {"implementation": "striped", "granularity": 64, "pattern": "vertical_slash",
        "vertical_slash": {"recall": 0.98, "last_q": 64, "block_size": 64, "sink_tokens": 64, "local_blocks": 2,
                           "max_vertical": 2048, "max_slash": 256}}
rows = []
for S in [int(x) for x in sys.argv[1].split(",")]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, S, 9, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(1, S, 3, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(1, S, 3, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k[:, :64] *= 3
    res = {"S": S}
    for name, cfg in (("eager", base), ("graphs", dict(base, cuda_graphs=True)),
                      ("dense", dict(base, dense_layers=[1]))):
        plan = resolve(cfg, cp_group=None, seq_len=S).for_layer(1)
        run = plan.attention_runner()
        torch.cuda.reset_peak_memory_stats(); m0 = torch.cuda.memory_allocated()
        t = time_forward_backward(lambda a, b, c: run(a, b, c, softmax_scale=0.125), q, k, v, device=q.device,
                                  warmup=3, repeats=10)
        res[name + "_ms"] = round(t.median_ms, 3)
        res[name + "_peak_gb"] = round((torch.cuda.max_memory_allocated() - m0) / 2**30, 3)
        res[name + "_kernels"] = plan.kernel_text(q)
        # host time per call (wall clock without sync)
        qq, kk, vv = (t_.detach().clone().requires_grad_(True) for t_ in (q, k, v))
        gout = torch.randn_like(q)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(5):
            out = run(qq, kk, vv, softmax_scale=0.125); torch.autograd.grad(out, (qq, kk, vv), gout)
        t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
        res[name + "_host_ms"] = round((t1 - t0) / 5 * 1e3, 3)
    print(json.dumps(res), flush=True)
    rows.append(res)
