import os, sys, datetime, torch, torch.distributed as dist
mode = sys.argv[1]
for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", sys.argv[2] if len(sys.argv) > 2 else "29533"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
    os.environ.setdefault(k, v)
torch.cuda.set_device(0)
def used(tag):
    f, t = torch.cuda.mem_get_info(); print(f"{mode:6s} {tag:28s} used {(t-f)/2**30:6.2f} GiB  torch reserved {torch.cuda.memory_reserved()/2**30:.2f}", flush=True)
torch.zeros(1, device="cuda"); used("context")
kw = {"device_id": torch.device("cuda", 0)} if mode == "bound" else {}
dist.init_process_group("gloo" if mode == "gloo" else "nccl", timeout=datetime.timedelta(minutes=5), **kw); used("init_process_group")
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1); used("initialize_model_parallel")
x = torch.ones(4, device="cuda")
dist.all_reduce(x); torch.cuda.synchronize(); used("all_reduce world")
for name in ("get_data_parallel_group", "get_tensor_model_parallel_group", "get_context_parallel_group", "get_pipeline_model_parallel_group", "get_model_parallel_group"):
    try:
        g = getattr(ps, name)(); dist.all_reduce(x, group=g); torch.cuda.synchronize(); used("all_reduce " + name[4:])
    except Exception as e:
        print(mode, name, "ERR", type(e).__name__, str(e)[:120])
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16); (a @ a).sum().item(); used("after a bf16 matmul")
ps.destroy_model_parallel(); dist.destroy_process_group()
