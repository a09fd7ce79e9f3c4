"""Sequence layouts for context parallelism: pure index maps, no communication.

A layout splits a length-``seq_len`` sequence into ``num_chunks`` equal chunks and gives each
CP rank an ordered list of chunks. Every rank holds ``seq_len // cp_size`` tokens, in
ascending global position.

* ``striped`` (MTraining §3.3, Fig. 5a): chunks of ``granularity`` tokens (default 64, the
  block size of the sparse kernels); chunk ``c`` goes to rank ``c mod cp_size``. ``granularity=1``
  is token striping. Requires ``seq_len % (cp_size * granularity) == 0``.
* ``zigzag`` (Megatron/TE "DualChunkSwap"): ``2 * cp_size`` chunks; rank ``r`` holds chunks
  ``r`` and ``2 * cp_size - 1 - r``. Requires ``seq_len % (2 * cp_size) == 0``.
* ``contiguous``: ``cp_size`` chunks, rank ``r`` holds chunk ``r`` (unbalanced under causal
  attention; used as a baseline and for imbalance accounting).

Example::

    lay = Layout("striped", cp_size=2, granularity=64)
    x_local = lay.shard(x, rank=1, dim=1)          # [b, s/2, ...]
    pos = lay.positions(rank=1, seq_len=s)         # global positions of x_local's tokens
    x_again = lay.unshard([lay.shard(x, r, 1) for r in range(2)], dim=1)
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Layout", "LAYOUT_KINDS", "PackedDocuments", "cu_seqlens_from_eod"]

LAYOUT_KINDS = ("striped", "zigzag", "contiguous")


@dataclass(frozen=True)
class Layout:
    """A CP sequence layout.

    Args:
        kind: ``"striped"``, ``"zigzag"`` or ``"contiguous"``.
        cp_size: number of context-parallel ranks (>= 1).
        granularity: striped chunk size in tokens (>= 1); ignored by the other kinds.

    Raises:
        TypeError: ``cp_size`` or ``granularity`` not an integer (a float such as ``64.0``, or a bool:
            ``True`` is an ``int`` in Python, so it is refused explicitly).
        ValueError: unknown kind, ``cp_size < 1`` or ``granularity < 1``.
    """

    kind: str = "striped"
    cp_size: int = 1
    granularity: int = 64

    def __post_init__(self):
        if self.kind not in LAYOUT_KINDS:
            raise ValueError(f"layout kind must be one of {LAYOUT_KINDS}, got {self.kind!r}")
        for name in ("cp_size", "granularity"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"Layout {name} must be an int, got {value!r} ({type(value).__name__})")
            object.__setattr__(self, name, int(value))     # numpy / other integral types -> int
        if self.cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {self.cp_size}")
        if self.granularity < 1:
            raise ValueError(f"granularity must be >= 1, got {self.granularity}")

    # ------------------------------------------------------------------ chunk structure
    @property
    def divisor(self) -> int:
        """The sequence length must be a multiple of this number."""
        if self.kind == "striped":
            return self.cp_size * self.granularity
        if self.kind == "zigzag":
            return 2 * self.cp_size
        return self.cp_size

    def rule(self) -> str:
        if self.kind == "striped":
            return (f"sequence length must be divisible by cp_size*granularity = "
                    f"{self.cp_size}*{self.granularity} = {self.divisor} (striped layout)")
        if self.kind == "zigzag":
            return f"sequence length must be divisible by 2*cp_size = {self.divisor} (zigzag layout)"
        return f"sequence length must be divisible by cp_size = {self.divisor} (contiguous layout)"

    def check_seq_len(self, seq_len: int) -> None:
        """Raise ``ValueError`` naming the rule when ``seq_len`` cannot be split."""
        if seq_len <= 0 or seq_len % self.divisor != 0:
            raise ValueError(f"cannot split a sequence of {seq_len} tokens: {self.rule()}")

    def num_chunks(self, seq_len: int) -> int:
        self.check_seq_len(seq_len)
        if self.kind == "striped":
            return seq_len // self.granularity
        if self.kind == "zigzag":
            return 2 * self.cp_size
        return self.cp_size

    def chunk_len(self, seq_len: int) -> int:
        return seq_len // self.num_chunks(seq_len)

    def local_len(self, seq_len: int) -> int:
        self.check_seq_len(seq_len)
        return seq_len // self.cp_size

    def chunk_ids(self, rank: int, seq_len: int) -> list[int]:
        """Global chunk indices held by ``rank``, in local order (ascending)."""
        self._check_rank(rank)
        n = self.num_chunks(seq_len)
        if self.kind == "striped":
            return list(range(rank, n, self.cp_size))
        if self.kind == "zigzag":
            return [rank, 2 * self.cp_size - 1 - rank]
        return [rank]

    # ------------------------------------------------------------------ token maps
    def positions(self, rank: int, seq_len: int, device=None) -> torch.Tensor:
        """Global positions (int64, shape ``[seq_len // cp_size]``, ascending) held by ``rank``.

        Built with ``torch.arange`` on ``device`` (no host-to-device copy, which on CUDA would
        synchronize the stream)."""
        c = self.chunk_len(seq_len)
        ids = self.chunk_ids(rank, seq_len)
        if self.cp_size == 1 or self.kind == "contiguous":          # one run of consecutive chunks
            return torch.arange(ids[0] * c, (ids[0] + len(ids)) * c, device=device)
        if self.kind == "zigzag":
            return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in ids])
        starts = torch.arange(rank * c, self.num_chunks(seq_len) * c, self.cp_size * c, device=device)
        return (starts[:, None] + torch.arange(c, device=device)[None, :]).reshape(-1)

    def global_to_local(self, t, seq_len: int):
        """Map global position(s) ``t`` (int or LongTensor) to ``(rank, local_index)``."""
        c = self.chunk_len(seq_len)
        chunk, off = t // c, t % c
        cp = self.cp_size
        if self.kind == "striped":
            return chunk % cp, (chunk // cp) * c + off
        if self.kind == "zigzag":
            first = chunk < cp
            if isinstance(first, torch.Tensor):
                rank = torch.where(first, chunk, 2 * cp - 1 - chunk)
                return rank, torch.where(first, off, c + off)
            return (chunk, off) if first else (2 * cp - 1 - chunk, c + off)
        return chunk, off

    def local_to_global(self, rank: int, local, seq_len: int):
        """Map local index(es) on ``rank`` to global position(s)."""
        self._check_rank(rank)
        c = self.chunk_len(seq_len)
        cp = self.cp_size
        j, off = local // c, local % c
        if self.kind == "striped":
            return (j * cp + rank) * c + off
        if self.kind == "zigzag":
            if isinstance(j, torch.Tensor):
                return torch.where(j == 0, rank, 2 * cp - 1 - rank) * c + off
            return (rank if j == 0 else 2 * cp - 1 - rank) * c + off
        return rank * c + off

    def permutation(self, seq_len: int, device=None) -> torch.Tensor:
        """``perm[i]`` = global position of element ``i`` of ``cat(shard(x, r) for r in ranks)``."""
        return torch.cat([self.positions(r, seq_len, device) for r in range(self.cp_size)])

    # ------------------------------------------------------------------ tensors
    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """This rank's part of ``x`` along ``dim`` (any batch size; returns a new contiguous tensor).

        Raises:
            ValueError: ``x.size(dim)`` cannot be split (see :meth:`rule`).
        """
        dim = dim % x.dim()
        s = x.size(dim)
        idx = self.positions(rank, s, device=x.device)
        return x.index_select(dim, idx).contiguous()

    def unshard(self, parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Inverse of :meth:`shard`: ``parts[r]`` is rank ``r``'s shard; returns the global tensor."""
        if len(parts) != self.cp_size:
            raise ValueError(f"unshard needs {self.cp_size} parts (one per CP rank), got {len(parts)}")
        dim = dim % parts[0].dim()
        cat = torch.cat(list(parts), dim=dim)
        inv = torch.argsort(self.permutation(cat.size(dim), device=cat.device))
        return cat.index_select(dim, inv)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank {rank} out of range for cp_size {self.cp_size}")


from .documents import PackedDocuments, cu_seqlens_from_eod  # noqa: E402  (pure index maps of packed streams)
