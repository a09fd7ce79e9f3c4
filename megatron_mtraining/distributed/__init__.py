"""Process-group helpers and the ring communicator.

Process groups are always passed explicitly (a Megatron CP group, or any sub-group of a larger
world); ``group=None`` means "no context parallelism" (one rank, no communication). Peers are
group-local ring neighbours translated to global ranks, so CP sub-groups of a TP×CP×DP world
work unchanged.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["group_size", "group_rank", "RingComm", "check_consistent_across_ranks"]

ProcessGroup = Optional[dist.ProcessGroup]


def group_size(group: ProcessGroup) -> int:
    if group is None:
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup) -> int:
    if group is None:
        return 0
    return dist.get_rank(group)


class RingComm:
    """Non-blocking exchange with the ring neighbours of a process group.

    ``exchange(send, recv)`` posts one batched send of every tensor in ``send`` to the next
    rank and one receive of every tensor in ``recv`` from the previous rank (group order),
    and returns a handle whose ``wait()`` completes them. Every rank posts the same sequence
    of exchanges, which keeps point-to-point messages matched on gloo and NCCL alike.
    """

    def __init__(self, group: ProcessGroup):
        self.group = group
        self.size = group_size(group)
        self.rank = group_rank(group)
        if self.size > 1:
            self.next_rank = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev_rank = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def exchange(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor]) -> "_Pending":
        if self.size == 1:
            raise RuntimeError("RingComm.exchange called on a group of size 1")
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next_rank, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev_rank, self.group) for t in recv]
        return _Pending(dist.batch_isend_irecv(ops), send, recv)


class _Pending:
    def __init__(self, works, send, recv):
        self._works, self._keep = works, (send, recv)   # keep buffers alive until completion
        self.recv = recv

    def wait(self):
        for w in self._works:
            w.wait()
        self._works = []
        return self.recv


_DTYPE_CODES = {torch.float64: 1, torch.float32: 2, torch.bfloat16: 3, torch.float16: 4}


def check_consistent_across_ranks(group: ProcessGroup, what: str, **fields) -> None:
    """Fail fast when ranks disagree (shapes, dtypes, layout...) before any ring exchange.

    One small ``all_gather`` of an int64 vector; every rank sees the same table and raises the
    same ``ValueError`` naming the mismatching fields per rank, so no rank is left waiting in a
    point-to-point call that will never be matched.

    Args:
        fields: name → int, tuple of ints, str, or torch.dtype. Values are encoded into a fixed
            length vector (tuples padded to 8 entries; strings hashed stably).
    """
    if group_size(group) == 1:
        return
    names = sorted(fields)
    vec = []
    for n in names:
        vec.extend(_encode(fields[n]))
    mine = torch.tensor(vec, dtype=torch.int64)
    backend = dist.get_backend(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mine = mine.to(dev)
    gathered = [torch.empty_like(mine) for _ in range(group_size(group))]
    dist.all_gather(gathered, mine, group=group)
    if all(torch.equal(g, gathered[0]) for g in gathered):
        return
    rows = []
    width = 9
    for r, g in enumerate(gathered):
        vals = g.view(len(names), width).tolist()
        rows.append(f"  group rank {r}: " + ", ".join(f"{n}={_decode(v)}" for n, v in zip(names, vals)))
    raise ValueError(f"{what}: ranks of the CP group disagree (all ranks must pass the same "
                     f"shapes, dtypes and layout):\n" + "\n".join(rows))


def _encode(value) -> list:
    """Fixed 9-slot encoding: [kind, n, v0..v6]."""
    if isinstance(value, torch.dtype):
        return [1, 1, _DTYPE_CODES.get(value, 99)] + [0] * 6
    if isinstance(value, str):
        h = 0
        for ch in value.encode():
            h = (h * 131 + ch) % (1 << 61)
        return [2, 1, h] + [0] * 6
    if isinstance(value, bool) or isinstance(value, int):
        return [3, 1, int(value)] + [0] * 6
    vals = [int(x) for x in value]
    if len(vals) > 7:
        raise ValueError("tuples of more than 7 ints are not supported")
    return [4, len(vals)] + vals + [0] * (7 - len(vals))


def _decode(slot) -> str:
    kind, n = slot[0], slot[1]
    if kind == 1:
        inv = {v: k for k, v in _DTYPE_CODES.items()}
        return str(inv.get(slot[2], "unknown dtype"))
    if kind == 2:
        return f"<str#{slot[2] % 100000}>"
    if kind == 3:
        return str(slot[2])
    return str(tuple(slot[2:2 + n]))
