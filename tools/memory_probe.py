"""Peak host memory of one ring-attention forward+backward per rank, for several cp sizes.

Each configuration runs in its own ``torch.distributed.run`` launch (gloo, CPU). Every rank
holds a *fixed* local shard (``--seq-local`` tokens), so a ring whose buffers are double-buffered
must show the same peak for every cp size; a ring that kept every step's K/V (or a gathered K/V)
would grow linearly with cp.

Probe: Linux ``/proc/self/status`` ``VmHWM`` (peak resident set). It is reset right before the
call through ``/proc/self/clear_refs`` (value 5), so the number is the peak *during* the call
minus the resident size just before it. Large tensors are ``mmap``-backed by glibc and handed
back on free, so the probe follows live tensor bytes closely.

    python tools/memory_probe.py --cp 1 2 4 --seq-local 4096 --heads 8 --head-dim 128 --json out.json

Prints a table (MiB) and, with ``--json``, writes ``{"rows": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from megatron_mtraining.layout import Layout
    from megatron_mtraining.ring import ring_attention

    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(cp))) if cp > 1 else None
    torch.manual_seed(rank)
    b, s, h, hkv, d = 1, args.seq_local, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(b, s, h, d, requires_grad=True)
    k = torch.randn(b, s, hkv, d, requires_grad=True)
    v = torch.randn(b, s, hkv, d, requires_grad=True)
    dout = torch.randn(b, s, h, d)
    layout = Layout("striped", cp, 64)
    ring_attention(q, k, v, layout=layout, group=group).backward(dout)      # warm-up
    q.grad = k.grad = v.grad = None
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss_kib("VmRSS")
    ring_attention(q, k, v, layout=layout, group=group).backward(dout)
    peak = _rss_kib("VmHWM")
    rows = [None] * cp
    dist.all_gather_object(rows, (peak - before) / 1024.0)
    if rank == 0:
        kv_mib = 2 * k.numel() * k.element_size() / 2**20
        q_mib = q.numel() * q.element_size() / 2**20
        with open(args.out, "w") as f:
            json.dump({"cp": cp, "peak_delta_mib_per_rank": rows, "kv_shard_mib": kv_mib, "q_shard_mib": q_mib}, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seq-local", type=int, default=4096, help="tokens per rank (fixed across cp sizes)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if any(cp < 1 for cp in args.cp):
        ap.error(f"--cp sizes must be >= 1, got {args.cp}")
    if args.seq_local < 64 or args.seq_local % 64:
        ap.error(f"--seq-local must be a positive multiple of 64 (the striped layout's 64-token chunks), "
                 f"got {args.seq_local}")
    from megatron_mtraining.bench.cli import check_heads, check_output_dir

    check_heads(ap, args.heads, args.kv_heads)
    if args.head_dim < 1:
        ap.error(f"--head-dim must be >= 1, got {args.head_dim}")
    check_output_dir(ap, "--json", args.json)
    rows = []
    for cp in args.cp:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            out = tmp.name
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cp), "--master-port",
               str(29400 + cp), __file__, "--worker", "--out", out, "--seq-local", str(args.seq_local),
               "--heads", str(args.heads), "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        try:
            subprocess.run(cmd, check=True, timeout=600, env=env, stdout=subprocess.DEVNULL)
            with open(out) as f:
                rows.append(json.load(f))
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"error: the cp {cp} run failed (exit {e.returncode}); its ranks' errors are above")
        except subprocess.TimeoutExpired:
            raise SystemExit(f"error: the cp {cp} run took more than 600 s")
        finally:
            os.unlink(out)
    print(f"{'cp':>3} | {'peak-during-call MiB (max over ranks)':>38} | {'K+V shard MiB':>13} | {'Q shard MiB':>11}")
    for r in rows:
        print(f"{r['cp']:>3} | {max(r['peak_delta_mib_per_rank']):>38.1f} | {r['kv_shard_mib']:>13.1f} | "
              f"{r['q_shard_mib']:>11.1f}")
    if args.json:
        from megatron_mtraining.bench import result_record, write_json

        write_json(args.json, result_record({"config": vars(args), "rows": rows}, device="cpu"))


if __name__ == "__main__":
    main()
