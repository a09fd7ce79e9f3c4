"""Online estimation of the vertical-slash attention pattern over a CP group (MTraining §3.2).

Every forward pass, from the current (already position-encoded) ``q`` and ``k`` shards:

1. **Probe queries.** The last ``last_q`` queries of the *whole* sequence (global positions
   ``S - last_q .. S - 1``) are gathered on every rank: each rank that holds some of them
   broadcasts its rows (``src`` translated group-local → global with ``dist.get_global_rank``,
   so any CP sub-group works). In a striped layout with granularity >= ``last_q`` this is one
   broadcast; in other layouts one per owner rank.
2. **Exact probe softmax across ranks.** Each rank computes the scaled logits of the probe
   queries against its local keys with the causal mask on *global* positions (a probe query
   never sees a key after itself): in fp64 torch (``impl="torch"``, the CPU / fp64 path and the
   oracle) or, on the GPU, in the fused Triton kernels of
   :mod:`megatron_mtraining.patterns.triton.estimator` (``impl="triton"``, the default for CUDA
   bf16/fp16/fp32 inputs: ``tl.dot`` in the input dtype, fp32 accumulation and softmax). Row max:
   ``all_reduce(MAX)``; row sum of ``exp(s - max)``: ``all_reduce(SUM)`` (fp64 in both paths).
   The resulting probabilities are the true softmax rows of the probes.
3. **Scores.** Vertical lines are scored at token level (column sums of the probe
   probabilities, ``[b, hq, S_local]``, stays local). Slash lines are scored at block level:
   the probability mass of all (probe query, key) pairs whose global ``block_size`` blocks differ by
   ``d = qblock - kblock`` — a ``[b, hq, S / block_size]`` vector, summed with one ``all_reduce``.
4. **Budgets (online, per query head).** Lines are taken in priority order — floors first, then
   decreasing score, ties broken by ascending position / offset — and the budget is the shortest
   prefix whose cumulative estimated mass reaches ``recall * last_q`` (the total mass of the probe
   rows): ``count = #(cumsum < target) + 1``, then ``max(count, #floors)`` and ``min(count, cap)``.
   Vertical and slash budgets are chosen independently, each reaching the target on its own (so
   their union covers at least ``recall`` of the estimated mass). ``recall == 1`` takes every
   line up to the cap (the pattern is then the full causal mask when the caps allow it).

   * Floors: the sink columns ``0 .. sink_tokens - 1`` are always vertical lines (token level,
     so ``sink_tokens`` need not be a multiple of the block size), and the ``local_blocks``
     nearest block diagonals ``d = 0 .. local_blocks - 1`` are always slash lines. Hence a head
     whose probe mass sits on one sink column keeps its local window, and a previous-token head
     keeps its diagonal (the two failure modes of a budget without floors).
   * Caps: ``max_vertical`` columns, ``max_slash`` block diagonals (per head).
5. **Distributed selection, no serial rank.** Each rank sorts its own columns by the priority
   order and keeps its top ``min(max_vertical, S_local)`` candidates (score, global position);
   one ``all_gather`` of these small sets, then every rank merges them with the same total order
   and selects the same lines. The union of the local top-``cap`` sets contains the global
   top-``cap``, so the result equals a selection over all columns. Slash scores are a tiny
   vector: ``all_reduce`` then identical selection on every rank.

Per query head by default (``VerticalSlashConfig.share_pattern="head"``): the recall target is a
per-head guarantee — pooling a sink head and a local head of one KV group lets the pooled mass
reach the target while one of the heads stays far below it. ``share_pattern="kv_group"`` trades
that guarantee for cheaper kernels: the scores of step 3 are averaged over the query heads of each
GQA group (each head's probe rows are softmax-normalised, so every head weighs the same and the mean
keeps the total mass ``last_q``), and steps 4-5 select one vertical set and one slash set per KV
head from that mean. The pattern then has ``hkv`` heads; the selection, the all-reduce of the slash
scores, the candidate all_gather and the index conversion run over ``hkv`` instead of ``hq`` heads
(the probe softmax stays per query head), and the Triton forward kernel computes several query
heads of a group against each K/V tile it loads (``KernelConfig.pack_gqa``). The ring moves whole K/V shards either way (no
communication is saved).

Invariance. The pattern is a property of the sequence: it does not depend on ``cp_size`` or the
layout beyond floating-point rounding. With ``impl="torch"`` scores are computed in fp64 from the
input values, every line has a unique position in the total priority order (ties broken by
position/offset, never by rank or local order), and candidate merging is rank-order independent.
Only reduction order differs between CP sizes (≈1e-16 relative), so a selection can change only if
two line scores agree to ~1e-15 or a cumulative sum lands within ~1e-15 of the target. The GPU path
(``impl="triton"``) computes the scores in fp32 from the input dtype (then casts them to fp64 for
the budgets and the selection, which are the same code): its scores differ from the fp64 path by
about 1e-6 relative (fp32 rounding of logits of magnitude ~10; the tests bound it by 1e-5), so on
the GPU the pattern can differ from the fp64 path — and between CP sizes / layouts, whose key tiles
differ — only where two line scores agree to ~1e-6 relative or a cumulative sum lands that close to
the target. Every rank still selects the same lines (the selection inputs are all-reduced or
all-gathered). On CUDA the slash ``index_add_`` uses atomics in both paths, so the last bits of a
slash score may vary from run to run.

Batch: every sample gets its own pattern (all tensors carry the batch dimension).

Cost per forward: ``b * hq * last_q * S_local * d`` MACs per pass, two passes (torch: fp64,
about 50 elementwise passes over fp64 ``[b, hq, last_q, chunk]`` logits, bandwidth-bound — 9.05 ms
at 64K and 28.4 ms at 128K on one H200 for the Qwen2.5-3B shape, 27–31 % of the sparse attention
kernels; Triton: tensor-core MACs, each pass reads the local K once and the probe queries, and
writes ``b * hq * ceil(S_local / BLOCK_N) * last_q`` fp32 partial (max, sum) pairs (pass 1) and
``b * hq * nu * S_local`` fp32 column sums (pass 2, ``nu`` = number of global query blocks the
probes span, 1 when ``last_q == block_size``); its GPU time has not been measured yet:
``tools/bench_estimator.py --impl triton`` reports it), one broadcast of ``b * last_q * hq * d``
values per owner rank, three all_reduces of ``b * hq * last_q`` / ``b * hq * S / block_size`` fp64
values and one all_gather of ``2 * b * hq * min(max_vertical, S_local)`` fp64 values. The selection
in torch: per row, two stable sorts over disjoint segments (the floors, the rest)
of the slash scores and of the local column scores (``[b, hq, S_local]``; fp32 keys on the Triton
path when the probes span one query block, else fp64), at cp > 1 a merge of the gathered candidates
(:func:`priority_order`), cumsums for the budgets and a sort of each kept set. On the Triton path with
static widths one kernel launch selects the slash lines and, at cp 1, the columns without sorting
(:mod:`megatron_mtraining.patterns.triton.select`; the same lines except where a cumulative sum lands
within fp64 rounding of the target, the covered masses to rounding); at
cp > 1 the columns keep the torch candidates and merge. **No host sync** with
static widths (the default on CUDA: the outputs are padded to the caps ``max_slash`` /
``max_vertical``, known on the host), one otherwise (the two output widths, read from the counts);
the probe gather's owner map is host arithmetic on Python ints, the key positions are built on the
device. Peak extra memory of the
torch path is bounded by key chunking (``_LOGIT_BUDGET`` elements); of the Triton path by the two
fp32 outputs above (and their fp64 copies).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.distributed as dist

from ..distributed import comm_context, group_rank, group_size
from ..layout import Layout
from .indices import packed_index_lists
from ..common import (REGION_ESTIMATOR_SCORES, REGION_ESTIMATOR_SELECTION, TRITON_DTYPES, check_softmax_scale,
                      record_function, resolve_softmax_scale, triton_runs_on)

__all__ = ["PROBES", "SHARE_PATTERNS", "VerticalSlashConfig", "VerticalSlashPattern", "estimate_vertical_slash",
           "floor_first_sort", "priority_order", "resolve_impl"]

#: Values of :attr:`VerticalSlashConfig.share_pattern`: one pattern per query head, or per KV head.
SHARE_PATTERNS = ("head", "kv_group")
#: Values of :attr:`VerticalSlashConfig.probes` (packed documents): the stream's last queries, or every document's.
PROBES = ("stream", "document")

# Max elements of one fp64 [b, hq, last_q, key_chunk] logit block (64 MiB).
_LOGIT_BUDGET = 1 << 23


@dataclass(frozen=True)
class VerticalSlashConfig:
    """Budget configuration of the online vertical-slash estimator.

    Args:
        recall: target fraction of the estimated attention mass (0 < recall <= 1) that the chosen
            vertical lines, and separately the chosen slash lines, must cover. 1.0 = every line
            (up to the caps).
        last_q: number of probe queries (the last ``last_q`` tokens of the sequence).
        block_size: slash granularity in tokens (64 for the kernels; block diagonals ``d``).
        sink_tokens: vertical floor — columns ``0 .. sink_tokens - 1`` are always kept.
        local_blocks: slash floor — block diagonals ``0 .. local_blocks - 1`` are always kept
            (>= 1, so every query always sees itself).
        max_vertical: cap on vertical columns per (sample, head); >= ``sink_tokens``.
        max_slash: cap on block diagonals per (sample, head); >= ``local_blocks``.
        share_pattern: ``"head"`` (default): one pattern per query head; ``"kv_group"``: one pattern
            per KV head, shared by the ``hq / hkv`` query heads of its GQA group (selected from the
            group's mean probe mass, see :func:`estimate_vertical_slash`; the Triton kernels then
            read one index list per group and pack several of its heads into one forward tile,
            ``KernelConfig.pack_gqa``).
        probes: which queries probe a stream of packed documents (no effect without documents):
            ``"stream"`` (default): the stream's last ``last_q`` queries, each scoring its own
            document; ``"document"``: the last ``last_q`` real queries of *every* document, each
            scoring its own document, all feeding one selection (one slash set and one column
            ranking per stream and head; the recall target applies to the mass of all probes).
            With ``impl="triton"`` both are scored by fused Triton kernels (``"document"``: the
            per-document kernels, whose work is each document's probes times its own keys); the
            probes of ``"document"`` grow with the number of documents (``last_q`` per document,
            gathered across the CP group), those of ``"stream"`` do not.

    Raises:
        ValueError: naming the offending field.
    """

    recall: float = 0.95
    last_q: int = 64
    block_size: int = 64
    sink_tokens: int = 64
    local_blocks: int = 2
    max_vertical: int = 4096
    max_slash: int = 1024
    share_pattern: str = "head"
    probes: str = "stream"

    def __post_init__(self) -> None:
        r = self.recall
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not (0.0 < float(r) <= 1.0):
            raise ValueError(f"VerticalSlashConfig.recall must be a number in (0, 1], got {r!r}")
        if self.share_pattern not in SHARE_PATTERNS:
            allowed = ", ".join(map(repr, SHARE_PATTERNS))
            raise ValueError(f"VerticalSlashConfig.share_pattern must be one of {allowed}, got {self.share_pattern!r}")
        if self.probes not in PROBES:
            allowed = ", ".join(map(repr, PROBES))
            raise ValueError(f"VerticalSlashConfig.probes must be one of {allowed}, got {self.probes!r}")
        for f in fields(self):
            if f.name in ("recall", "share_pattern", "probes"):
                continue
            val = getattr(self, f.name)
            if isinstance(val, bool) or not isinstance(val, int):
                raise ValueError(f"VerticalSlashConfig.{f.name} must be an int, got {val!r}")
        for name, lo in (("last_q", 1), ("block_size", 1), ("sink_tokens", 0), ("local_blocks", 1)):
            if getattr(self, name) < lo:
                raise ValueError(f"VerticalSlashConfig.{name} must be >= {lo}, got {getattr(self, name)}")
        if self.max_vertical < self.sink_tokens:
            raise ValueError(f"VerticalSlashConfig.max_vertical ({self.max_vertical}) must be >= sink_tokens "
                             f"({self.sink_tokens}): the sink floor must fit under the cap")
        if self.max_slash < self.local_blocks:
            raise ValueError(f"VerticalSlashConfig.max_slash ({self.max_slash}) must be >= local_blocks "
                             f"({self.local_blocks}): the local-window floor must fit under the cap")


@dataclass
class VerticalSlashPattern:
    """A global vertical-slash pattern, one per (sample, query head).

    Mask: ``M[b, h, p, t] = (t <= p) and ((p // bs - t // bs) in slash[b, h] or t in vertical[b, h])``.

    Attributes:
        seq_len, block_size: global sequence length and slash block size.
        slash: ``[b, hq, ns]`` int64 block-diagonal offsets ``d >= 0``, ascending, padded with -1.
        slash_count: ``[b, hq]`` int64 number of valid entries of ``slash``.
        vertical: ``[b, hq, nv]`` int64 global key positions, ascending, padded with -1.
        vertical_count: ``[b, hq]`` int64.
        est_slash_mass, est_vertical_mass: ``[b, hq]`` fp64 fraction of the probe mass covered by
            the chosen slash / vertical lines (estimator diagnostics; ``None`` for hand-built patterns).
        vertical_ascending: host record that every row of ``vertical`` is strictly ascending with its
            ``-1`` padding after the last position (the estimator's patterns; ``False``: not known). The
            Triton conversion at cp 1 then also hands the backward's column plan each row's vertical list
            as its column union (:class:`~megatron_mtraining.patterns.indices.ColumnUnion`).
        slash_ascending: host record that every row of ``slash`` is strictly ascending with its ``-1``
            padding after the last offset (the estimator's and :meth:`coarsen`'s patterns; ``False``: not
            known). The Triton conversion at cp 1 then reads each row backwards for its descending offsets
            instead of sorting them.
    """

    seq_len: int
    block_size: int
    slash: torch.Tensor
    slash_count: torch.Tensor
    vertical: torch.Tensor
    vertical_count: torch.Tensor
    est_slash_mass: Optional[torch.Tensor] = None
    est_vertical_mass: Optional[torch.Tensor] = None
    vertical_ascending: bool = False
    slash_ascending: bool = False

    @classmethod
    def from_lists(cls, seq_len: int, block_size: int, slash, vertical) -> "VerticalSlashPattern":
        """Build from nested Python lists ``slash[b][h]`` (offsets) and ``vertical[b][h]`` (positions); each
        row is stored sorted ascending without repeats, -1 padded (a -1 in a row is padding and is dropped;
        ``slash_ascending``)."""
        def pad(rows):
            # each row's distinct entries, ascending; -1 is padding, not an entry
            rows = [[sorted(set(int(v) for v in x) - {-1}) for x in r] for r in rows]
            b, h = len(rows), len(rows[0])
            width = max(1, max(len(vals) for r in rows for vals in r))
            out = torch.full((b, h, width), -1, dtype=torch.long)
            cnt = torch.zeros((b, h), dtype=torch.long)
            for i, r in enumerate(rows):
                for j, vals in enumerate(r):
                    out[i, j, :len(vals)] = torch.tensor(vals, dtype=torch.long)
                    cnt[i, j] = len(vals)
            return out, cnt

        s, sc = pad(slash)
        v, vc = pad(vertical)
        nb = seq_len // block_size
        if ((s >= nb) | ((s < 0) & (s != -1))).any() or ((v >= seq_len) | ((v < 0) & (v != -1))).any():
            raise ValueError("pattern entries out of range (slash offsets in [0, S/bs), vertical in [0, S))")
        return cls(seq_len, block_size, s, sc, v, vc, slash_ascending=True)

    @property
    def batch(self) -> int:
        return self.slash.shape[0]

    @property
    def num_heads(self) -> int:
        return self.slash.shape[1]

    @property
    def num_blocks(self) -> int:
        return self.seq_len // self.block_size

    def coarsen(self, block_size: int) -> "VerticalSlashPattern":
        """The pattern with its slash lines rounded up to ``block_size`` blocks (a multiple of
        ``self.block_size``): every coarse tile that a selected fine diagonal touches is kept, so the
        mask only grows (a fine diagonal ``d`` touches the coarse diagonals ``floor(d/f)`` and
        ``ceil(d/f)``, ``f = block_size / self.block_size``). Vertical columns are unchanged.

        Raises:
            ValueError: ``block_size`` is not a multiple of ``self.block_size`` or does not divide
                ``seq_len``.
        """
        if block_size % self.block_size or self.seq_len % block_size:
            raise ValueError(f"block_size {block_size} must be a multiple of {self.block_size} and divide "
                             f"seq_len {self.seq_len}")
        f = block_size // self.block_size
        if f == 1:
            return self
        nb = self.seq_len // block_size
        ok = self.slash >= 0
        d = self.slash.clamp(min=0)
        hit = torch.zeros(*self.slash.shape[:2], nb + 1, dtype=torch.bool, device=self.slash.device)
        for part in (d // f, (d + f - 1) // f):
            hit.scatter_(-1, torch.where(ok, part.clamp(max=nb - 1), torch.full_like(part, nb)), True)
        cnt, slash = packed_index_lists(hit[..., :nb], fill=-1, dtype=torch.int64)
        return VerticalSlashPattern(self.seq_len, block_size, slash, cnt, self.vertical, self.vertical_count,
                                    vertical_ascending=self.vertical_ascending, slash_ascending=True)

    def check(self) -> None:
        """Validate a hand-built pattern (one host synchronisation): integer ``[b, hq, n]`` lists, every entry
        ``-1`` (padding) or in range (slash offsets in ``[0, S / bs)``, vertical positions in ``[0, S)``), and
        the vertical positions of each row distinct: the conversion lists a repeated column twice and the
        kernels would count it twice. Order and repeated slash offsets do not change the mask. A row of a
        list recorded as ascending (``slash_ascending``, ``vertical_ascending``) must be strictly ascending
        with its ``-1`` padding after the last entry. The estimator's patterns hold this by construction.

        Raises:
            ValueError: naming the list and the rule.
        """
        if self.block_size < 1 or self.seq_len < 1 or self.seq_len % self.block_size:
            raise ValueError(f"VerticalSlashPattern: seq_len {self.seq_len} must be a positive multiple of "
                             f"block_size {self.block_size}")
        for name, x, hi in (("slash", self.slash, self.num_blocks), ("vertical", self.vertical, self.seq_len)):
            if x.dtype not in (torch.int64, torch.int32) or x.dim() != 3 or x.shape[:2] != self.slash.shape[:2]:
                raise ValueError(f"VerticalSlashPattern: {name} must be an int64 (or int32) [b, hq, n] tensor (the "
                                 f"slash list's b, hq), got {tuple(x.shape)} {x.dtype}")
            if not bool(((x == -1) | ((x >= 0) & (x < hi))).all()):
                raise ValueError(f"VerticalSlashPattern: {name} entries must be -1 (padding) or in [0, {hi})")
        for name, x, flag in (("slash", self.slash, self.slash_ascending),
                              ("vertical", self.vertical, self.vertical_ascending)):
            ok = x >= 0
            if flag and bool(((ok[..., 1:] & ~ok[..., :-1]) | (ok[..., 1:] & (x[..., 1:] <= x[..., :-1]))).any()):
                raise ValueError(f"VerticalSlashPattern: {name}_ascending is set, but a row of {name} is not strictly "
                                 f"ascending with its -1 padding after the last entry")
        v = self.vertical.sort(dim=-1).values
        if bool(((v[..., 1:] == v[..., :-1]) & (v[..., 1:] >= 0)).any()):
            raise ValueError("VerticalSlashPattern: a vertical position is listed twice in one (sample, head) row; "
                             "the kernels would count that key twice")

    def to(self, device) -> "VerticalSlashPattern":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return VerticalSlashPattern(self.seq_len, self.block_size, mv(self.slash), mv(self.slash_count),
                                    mv(self.vertical), mv(self.vertical_count), mv(self.est_slash_mass),
                                    mv(self.est_vertical_mass), self.vertical_ascending, self.slash_ascending)

    def slash_mask(self, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """``[b, hq, S / bs]`` of ``dtype`` (bool, or e.g. int8 for a kernel): block diagonal ``d`` selected
        (1 / True). A view of a ``[b, hq, S / bs + 1]`` buffer (the padding's slot cut off)."""
        m = torch.zeros(self.batch, self.num_heads, self.num_blocks + 1, dtype=dtype, device=self.slash.device)
        idx = torch.where(self.slash >= 0, self.slash, self.num_blocks)
        m.scatter_(-1, idx, 1)
        return m[..., :-1]

    def vertical_mask(self) -> torch.Tensor:
        """``[b, hq, S]`` bool: key column selected."""
        m = torch.zeros(self.batch, self.num_heads, self.seq_len + 1, dtype=torch.bool, device=self.vertical.device)
        idx = torch.where(self.vertical >= 0, self.vertical, self.seq_len)
        m.scatter_(-1, idx, True)
        return m[..., :-1]

    def dense_mask(self, seq_len: Optional[int] = None) -> torch.Tensor:
        """``[b, hq, S, S]`` bool token-level mask (query row, key column). For tests (small S only)."""
        s = self.seq_len if seq_len is None else int(seq_len)
        if s != self.seq_len:
            raise ValueError(f"pattern was built for seq_len {self.seq_len}, asked for {s}")
        dev = self.slash.device
        pos = torch.arange(s, device=dev)
        d = pos[:, None] // self.block_size - pos[None, :] // self.block_size
        causal = pos[None, :] <= pos[:, None]
        on_slash = self.slash_mask()[..., d.clamp(min=0)] & (d >= 0)
        on_vert = self.vertical_mask()[:, :, None, :]
        return causal & (on_slash | on_vert)

    def kept_fraction(self) -> torch.Tensor:
        """``[b, hq]`` fp64: the fraction of the causal (query, key) pairs inside the mask, exact (a column's
        rows already inside a selected block diagonal count once). On the pattern's device, without a host
        synchronisation: O(``b * hq * (S / bs + nv)``) work.

        The work a training step keeps is this fraction of dense causal attention (before the kernels
        round it to 64 x 64 tiles)."""
        bs, nb, S = self.block_size, self.num_blocks, self.seq_len
        sm = self.slash_mask().to(torch.float64)                                  # [b, h, nb], offset x
        x = torch.arange(nb, device=sm.device, dtype=torch.float64)
        per_offset = torch.where(x == 0, nb * bs * (bs + 1) / 2, (nb - x) * bs * bs)
        slash_pairs = (sm * per_offset).sum(-1)
        has0 = sm[..., 0]
        # number of selected offsets 1 .. n, for n = 0 .. nb - 1
        upto = torch.cat([torch.zeros_like(sm[..., :1]), sm[..., 1:].cumsum(-1)], -1)
        valid = self.vertical >= 0
        t = torch.where(valid, self.vertical, 0)
        kb, r = t // bs, t % bs
        covered = bs * upto.gather(-1, nb - 1 - kb) + has0[..., None] * (bs - r)
        col_pairs = torch.where(valid, ((S - t) - covered).clamp(min=0).to(torch.float64), 0.0).sum(-1)
        return (slash_pairs + col_pairs) / (S * (S + 1) / 2)

    def same_selection(self, other: "VerticalSlashPattern") -> bool:
        """True when both patterns select exactly the same lines (diagnostics ignored)."""
        return (self.seq_len == other.seq_len and self.block_size == other.block_size
                and torch.equal(self.slash_mask().cpu(), other.slash_mask().cpu())
                and torch.equal(self.vertical_mask().cpu(), other.vertical_mask().cpu()))


# ----------------------------------------------------------------------------------- helpers
def priority_order(score: torch.Tensor, floor: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Permutation (along the last dim) sorting lines by: floor first, score descending, key ascending.

    A strict total order as long as ``key`` values are distinct, so the result does not depend on
    the input order (and therefore not on the rank or layout the candidates came from).
    """
    key = key.expand_as(score)
    floor = floor.expand_as(score)
    order = torch.argsort(key, dim=-1, stable=True)
    s = score.gather(-1, order)
    o2 = torch.argsort(s, dim=-1, descending=True, stable=True)
    order = order.gather(-1, o2)
    f = floor.gather(-1, order).to(torch.int8)
    o3 = torch.argsort(f, dim=-1, descending=True, stable=True)
    return order.gather(-1, o3)


def floor_first_sort(score: torch.Tensor, n_floor: int, keep: Optional[int] = None):
    """Lines sorted by :func:`priority_order` when their keys ascend along the last dim and their floors
    are exactly the first ``n_floor`` lines (slash offsets ``0..nb-1``; a rank's local columns, whose
    global positions ascend, with the sinks first).

    Returns ``(sorted score, order)``, both truncated to the first ``keep`` entries (default: all).
    The permutation is the one ``priority_order(score, idx < n_floor, idx)`` returns: that order is
    the stable descending score order (ties: ascending key = ascending index) restricted first to the
    floors, then to the other lines, and with ascending keys each restriction is the stable
    descending sort of its own contiguous segment. Hence two sorts over disjoint segments (one when
    either segment is empty) instead of three sorts and four gathers over the whole row, and the
    sorted scores come out of the sorts (no gather).
    """
    n = score.shape[-1]
    nf = min(max(n_floor, 0), n)
    keep = n if keep is None else min(keep, n)
    if nf == 0 or nf == n:
        v, o = torch.sort(score, dim=-1, descending=True, stable=True)
        return v[..., :keep], o[..., :keep]
    vf, of = torch.sort(score[..., :nf], dim=-1, descending=True, stable=True)
    if keep <= nf:
        return vf[..., :keep], of[..., :keep]
    vr, orr = torch.sort(score[..., nf:], dim=-1, descending=True, stable=True)
    return torch.cat([vf, vr[..., :keep - nf]], -1), torch.cat([of, orr[..., :keep - nf] + nf], -1)


def _budget(sorted_score: torch.Tensor, n_floor: int, cap: int, target: float, take_all: bool):
    """Count of the shortest prefix reaching ``target`` (``#(cumsum < target) + 1``), floors/caps applied.

    Returns ``(count [...], covered [...])`` where ``covered`` is the summed score of the prefix.
    """
    n = sorted_score.shape[-1]
    shape, dev = sorted_score.shape[:-1], sorted_score.device
    lo, hi = min(n_floor, n), min(cap, n)
    if hi <= 0:                                   # n == 0 or cap == 0: nothing is taken
        return (torch.zeros(shape, dtype=torch.long, device=dev),
                torch.zeros(shape, dtype=sorted_score.dtype, device=dev))
    cum = torch.cumsum(sorted_score, dim=-1)
    if take_all:                                  # every line up to the cap: a constant count
        return torch.full(shape, hi, dtype=torch.long, device=dev), cum[..., hi - 1]
    # count - 1 = clamp(#(cum < target), lo - 1, hi - 1) (>= 0 since hi >= 1): the gather index
    last = (cum < target).sum(-1).clamp_(min=lo - 1, max=hi - 1)
    return last + 1, cum.gather(-1, last[..., None]).squeeze(-1)


def _widths(*counts, static: bool = False) -> list:
    """Output widths of :func:`_take_sorted` for ``(count, n, cap)`` triples: ``max(1, min(n, count.max()))``
    each, with one host sync for all of them (the output shapes are data dependent); with ``static``
    the bound ``max(1, min(n, cap))`` instead (``count <= min(n, cap)`` by :func:`_budget`), no device read."""
    if static:
        return [max(1, min(n, cap)) for _, n, cap in counts]
    live = [i for i, (cnt, n, _) in enumerate(counts) if cnt.numel() and n]
    maxes = torch.stack([counts[i][0].amax() for i in live]).tolist() if live else []
    out = [1] * len(counts)
    for i, m in zip(live, maxes):
        out[i] = max(1, min(counts[i][1], int(m)))
    return out


def _take_sorted(sorted_vals: torch.Tensor, cnt: torch.Tensor, width: int, sentinel: int) -> torch.Tensor:
    """First ``cnt`` entries of each row, re-sorted ascending, padded with -1 to ``width`` (the max
    count, from :func:`_widths`). Entries are distinct and ``< sentinel``, so after the sort the
    padding sits exactly at the slots ``>= cnt``. The values (non-negative integers) are sorted as
    int32 when the sentinel fits (half the key bytes of int64: fewer radix passes), returned in
    ``sorted_vals``' dtype."""
    if sorted_vals.shape[-1] == 0:
        return torch.full((*sorted_vals.shape[:-1], 1), -1, dtype=torch.long, device=sorted_vals.device)
    drop = torch.arange(width, device=sorted_vals.device) >= cnt[..., None]
    keys = sorted_vals[..., :width].masked_fill(drop, sentinel)
    if sentinel < 2 ** 31 and not keys.is_floating_point():
        keys = keys.to(torch.int32)
    vals = torch.sort(keys, dim=-1).values.to(sorted_vals.dtype)
    return vals.masked_fill_(drop, -1)


def _count_below(layout: Layout, rank: int, seq_len: int, t: int) -> int:
    """Number of ``rank``'s positions ``< t`` (host arithmetic on the chunk structure, no device op)."""
    c, n = layout.chunk_len(seq_len), 0
    for i in layout.chunk_ids(rank, seq_len):      # ascending
        if i * c >= t:
            break
        n += min(c, t - i * c)
    return n


def _local_candidates(col: torch.Tensor, k_pos: torch.Tensor, n_floor: int, kc: int, positions_are_local: bool):
    """This rank's top-``kc`` columns in priority order: ``(score fp64 [b, hq, kc], global position int64)``.

    ``n_floor``: number of local sink columns (``k_pos < sink_tokens``, the first ones, since ``k_pos``
    ascends); ``positions_are_local``: ``k_pos == arange`` (cp 1), the order is then the position."""
    score, order = floor_first_sort(col, n_floor, kc)
    return score.to(torch.float64), (order if positions_are_local else k_pos[order])


def _merge_candidates(c_score: torch.Tensor, c_pos: torch.Tensor, sink_tokens: int):
    """All ranks' candidates (concatenated, any order, distinct positions) in priority order."""
    g_order = priority_order(c_score, c_pos < sink_tokens, c_pos)
    return c_score.gather(-1, g_order), c_pos.gather(-1, g_order)


def _all_gather_candidates(score: torch.Tensor, pos: torch.Tensor, group, cp: int):
    """Concatenation over the CP group (rank order) of every rank's ``(score, pos)`` candidates."""
    cand = torch.stack([score, pos.to(score.dtype)])
    parts = [torch.empty_like(cand) for _ in range(cp)]
    with comm_context("vertical-slash estimator: all_gather of the vertical candidates", group):
        dist.all_gather(parts, cand.contiguous(), group=group)
    cand = torch.cat(parts, dim=-1)
    return cand[0], cand[1].round().long()


def _select(slash: torch.Tensor, col: torch.Tensor, k_pos: torch.Tensor, layout: Layout, rank: int, S: int, L: int,
            config: VerticalSlashConfig, gather=None, static_widths: bool = False,
            fused: bool = False) -> VerticalSlashPattern:
    """Budgets and selection (step 4/5 of the module docstring) from the scores: ``slash [b, hq, S/bs]``
    fp64 (all-reduced), this rank's ``col [b, hq, S_local]`` at ``k_pos`` (fp64, or fp32 values that
    the fp64 path would hold exactly: the fused path with one probe query block).

    ``gather`` (cp > 1): ``(score, pos) -> (score, pos)`` concatenated over the CP group in rank order
    (:func:`_all_gather_candidates`). Torch ops on the device and one host sync (the widths), none
    with ``static_widths`` (the widths are then the caps, see :func:`estimate_vertical_slash`).
    ``fused`` with ``static_widths``: the Triton selection kernel
    (:func:`megatron_mtraining.patterns.triton.select.select_line_kinds`) selects the slash lines and, at
    cp 1, the vertical lines (one launch for both, no sort)."""
    nb, sl = slash.shape[-1], col.shape[-1]
    target = float(config.recall) * L
    take_all = float(config.recall) >= 1.0
    kernel = fused and static_widths
    if kernel:
        from .triton.select import select_line_kinds

        # slash lines (identical on every rank; floors = offsets 0 .. local_blocks - 1) and, at cp 1, the
        # columns (the local columns are the sequence: positions = indices), side by side in one launch
        kinds = [(slash, config.local_blocks, config.max_slash, target, take_all,
                  _widths((None, nb, config.max_slash), static=True)[0], L)]
        if layout.cp_size == 1:
            kinds.append((col, min(config.sink_tokens, S), config.max_vertical, target, take_all,
                          _widths((None, sl, config.max_vertical), static=True)[0], L))
        picked = select_line_kinds(*kinds)
        s_sel, s_cnt, s_mass = picked[0]
        if layout.cp_size == 1:
            v_sel, v_cnt, v_mass = picked[1]
            return VerticalSlashPattern(S, config.block_size, s_sel, s_cnt, v_sel, v_cnt,
                                        est_slash_mass=s_mass, est_vertical_mass=v_mass, vertical_ascending=True,
                                        slash_ascending=True)
    else:
        s_score, s_order = floor_first_sort(slash, config.local_blocks)
        s_cnt, s_cov = _budget(s_score, config.local_blocks, config.max_slash, target, take_all)

    # --- vertical selection: at cp 1 one sorted candidate list (the merge would sort an already sorted
    # list: the identity); at cp > 1 local top-cap candidates, one all_gather, identical merge everywhere.
    kc = min(config.max_vertical, sl)
    v_score, v_pos = _local_candidates(col, k_pos, _count_below(layout, rank, S, config.sink_tokens), kc,
                                       positions_are_local=layout.cp_size == 1)
    if layout.cp_size > 1:
        v_score, v_pos = _merge_candidates(*gather(v_score, v_pos), config.sink_tokens)
    v_cnt, v_cov = _budget(v_score, min(config.sink_tokens, S), config.max_vertical, target, take_all)
    v_mass = v_cov / L
    if kernel:
        wv = _widths((v_cnt, v_pos.shape[-1], config.max_vertical), static=True)[0]
    else:
        ws, wv = _widths((s_cnt, nb, config.max_slash), (v_cnt, v_pos.shape[-1], config.max_vertical),
                         static=static_widths)                            # the one host sync (unless static)
        s_sel, s_mass = _take_sorted(s_order, s_cnt, ws, sentinel=nb), s_cov / L
    v_sel = _take_sorted(v_pos, v_cnt, wv, sentinel=S)
    return VerticalSlashPattern(S, config.block_size, s_sel, s_cnt, v_sel, v_cnt,
                                est_slash_mass=s_mass, est_vertical_mass=v_mass, vertical_ascending=True,
                                slash_ascending=True)


def _document_floors(documents, sink_tokens: int) -> tuple[torch.Tensor, list]:
    """``(sink [b, S] bool, floors per stream)``: the first ``sink_tokens`` real tokens of every
    document (host counts from the offsets, no device read)."""
    S = documents.seq_len
    pos = torch.arange(S, device=documents.lo.device)[None, :] - documents.doc_start
    sink = (documents.hi >= 0) & (pos < sink_tokens)
    per_row = [0] * documents.batch_size
    cu, pad = documents.cu_seqlens, documents.cu_seqlens_padded
    for i in range(len(cu) - 1):
        n = cu[i + 1] - cu[i]
        if n > 0:
            per_row[pad[i] // S] += min(n, sink_tokens)
    return sink, per_row


def _select_documents(slash: torch.Tensor, col: torch.Tensor, k_pos: torch.Tensor, S: int, L: int,
                      config: VerticalSlashConfig, gather, documents, n_real=None) -> VerticalSlashPattern:
    """:func:`_select` for packed documents: per-document sink floors, the recall target of each
    stream's real probes, the vertical cap raised to the floors where they exceed it (one host sync).
    ``n_real``: ``[b]`` real probes per stream (default: the real tokens among the last ``L``);
    the estimated masses are fractions of it (of ``L`` for the stream's probes)."""
    b, h, sl = col.shape
    nb, dev = slash.shape[-1], col.device
    sink, floors = _document_floors(documents, config.sink_tokens)
    norm = L
    if n_real is None:
        n_real = (documents.hi[:, S - L:] >= 0).sum(-1).to(torch.float64)           # [b]
    else:
        n_real = n_real.to(device=dev, dtype=torch.float64)
        norm = n_real.clamp(min=1)[:, None]
    target = (float(config.recall) * n_real)[:, None, None]
    take_all = float(config.recall) >= 1.0

    def budget(sorted_score, n_floor: list, cap: list):
        n = sorted_score.shape[-1]
        if n == 0:                                # no candidate line (a cap of 0 and no floor): nothing taken
            zero = torch.zeros(sorted_score.shape[:-1], dtype=sorted_score.dtype, device=dev)
            return zero.long(), zero
        lo = torch.tensor([min(f, n) for f in n_floor], device=dev)[:, None]
        hi = torch.tensor([min(c, n) for c in cap], device=dev)[:, None]
        cum = torch.cumsum(sorted_score, dim=-1)
        if take_all:
            last = (hi - 1).expand(sorted_score.shape[:-1])
        else:
            last = torch.minimum(torch.maximum((cum < target).sum(-1), lo - 1), hi - 1)
        cnt = torch.where(hi > 0, last + 1, torch.zeros_like(last))
        cov = torch.where(hi > 0, cum.gather(-1, last.clamp(min=0)[..., None]).squeeze(-1),
                          torch.zeros_like(cum[..., 0]))
        return cnt, cov

    s_score, s_order = floor_first_sort(slash, config.local_blocks)
    s_cnt, s_cov = budget(s_score, [config.local_blocks] * b, [config.max_slash] * b)

    caps = [max(config.max_vertical, f) for f in floors]
    kc = min(max(caps), sl)
    loc_floor = sink.index_select(1, k_pos)[:, None, :]                              # [b, 1, sl]
    order = priority_order(col, loc_floor, k_pos)[..., :kc]
    v_score, v_pos = col.gather(-1, order).to(torch.float64), k_pos[order]
    if gather is not None:
        c_score, c_pos = gather(v_score, v_pos)
        g_floor = sink[:, None, :].expand(b, h, S).gather(-1, c_pos)
        g_order = priority_order(c_score, g_floor, c_pos)
        v_score, v_pos = c_score.gather(-1, g_order), c_pos.gather(-1, g_order)
    v_cnt, v_cov = budget(v_score, floors, caps)

    ws, wv = _widths((s_cnt, nb, config.max_slash), (v_cnt, v_pos.shape[-1], max(caps)))
    s_sel = _take_sorted(s_order, s_cnt, ws, sentinel=nb)
    v_sel = _take_sorted(v_pos, v_cnt, wv, sentinel=S)
    return VerticalSlashPattern(S, config.block_size, s_sel, s_cnt, v_sel, v_cnt,
                                est_slash_mass=s_cov / norm, est_vertical_mass=v_cov / norm, vertical_ascending=True,
                                slash_ascending=True)


def _document_probe_positions(documents, last_q: int) -> list:
    """Per stream, the ascending stream positions of the last ``last_q`` real tokens of every document
    (all of a shorter document's) -- host lists from the offsets, no device read."""
    return [[t for _, _, probes in docs for t in probes] for docs in _document_probe_spans(documents, last_q)]


def _document_probe_spans(documents, last_q: int) -> list:
    """Per stream, ``(s0, s1, probes)`` of each non-empty document in stream order: its real tokens
    ``s0:s1`` (stream positions) and ``probes``, the positions of its last ``last_q`` real tokens
    (host arithmetic on the offsets)."""
    S = documents.seq_len
    cu, pad = documents.cu_seqlens, documents.cu_seqlens_padded
    out = [[] for _ in range(documents.batch_size)]
    for i in range(len(cu) - 1):
        n = cu[i + 1] - cu[i]
        if n > 0:
            row, s0 = pad[i] // S, pad[i] % S
            out[row].append((s0, s0 + n, range(s0 + max(0, n - last_q), s0 + n)))
    return out


def _to_device(dev: torch.device, *host: torch.Tensor) -> list:
    """The integer CPU tensors ``host`` on ``dev`` as int64 views of one copy: pinned and asynchronous
    on CUDA (the host does not wait for the stream), a plain copy elsewhere."""
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in host])
    flat = flat.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else flat.to(dev)
    out, o = [], 0
    for t in host:
        out.append(flat[o:o + t.numel()].view(t.shape))
        o += t.numel()
    return out


def _row_owners(layout: Layout, rank: int, seq_len: int, positions: torch.Tensor):
    """``(slots, locs)`` int64 CPU: the rows of ``positions`` (global, CPU) that ``rank`` holds, and
    their local indices (vectorised host arithmetic)."""
    owner, loc = layout.global_to_local(positions, seq_len)
    mine = torch.as_tensor(owner) == rank
    return mine.nonzero()[:, 0], torch.as_tensor(loc)[mine]


def _gather_rows(q: torch.Tensor, group, cp: int, slots: torch.Tensor, locs: torch.Tensor, n: int):
    """``[n, hq, d]``: rows of one stream's queries ``q [s_local, hq, d]`` gathered on every rank: each
    rank copies the rows it holds (``q[locs]`` into rows ``slots``, device tensors), zeros elsewhere,
    then one all_reduce SUM (every row has one owner, so the sum is that row exactly)."""
    out = q.new_zeros((n, *q.shape[1:]))
    if slots.numel():
        out.index_copy_(0, slots, q.index_select(0, locs))
    if cp > 1:
        with comm_context("vertical-slash estimator: all_reduce of the per-document probe queries", group):
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def _query_block_runs(p0: int, p1: int, bs: int) -> list:
    """``(u, r0, r1)`` for probes at the consecutive global positions ``p0 .. p1 - 1``: the probe rows
    ``r0:r1`` (relative to ``p0``) that lie in global query block ``u``, for every block they touch."""
    return [(u, max(0, u * bs - p0), min(p1 - p0, (u + 1) * bs - p0)) for u in range(p0 // bs, (p1 - 1) // bs + 1)]


def _document_probe_tables(docs: list, host_pos: torch.Tensor, bs: int, block_m: int, block_n: int):
    """Host tables of the fused per-document score kernels for one stream (no device read).

    ``docs``: the stream's ``(s0, s1, probes)`` (:func:`_document_probe_spans`); ``host_pos``: this
    rank's ascending key positions (CPU). Returns ``(key_range [ceil(P / block_m), 2], groups [G, 2],
    group_u [G], tile_groups [ceil(S_local / block_n), 2], max_groups)`` int64 CPU tensors (and an
    int): the local key range ``[a, e)`` that each block of probe rows sees (from its first
    document's first local key to its last document's end), the probe row range and global query
    block of every group (one document's probes inside one query block, in row order), and the
    groups ``[g0, g1)`` of the documents that a tile of local keys meets (by position)."""
    n = [len(probes) for _, _, probes in docs]
    P, sl = sum(n), host_pos.numel()
    s0 = torch.tensor([d[0] for d in docs], dtype=torch.int64)
    s1 = torch.tensor([d[1] for d in docs], dtype=torch.int64)
    a, e = torch.searchsorted(host_pos, s0), torch.searchsorted(host_pos, s1)
    row_doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(n))
    first = torch.arange(0, P, block_m)
    key_range = torch.stack([a[row_doc[first]], e[row_doc[torch.clamp(first + block_m, max=P) - 1]]], -1)
    groups, group_u, gstart, r = [], [], [0], 0
    for _, _, probes in docs:
        for u, r0, r1 in _query_block_runs(probes.start, probes.stop, bs):
            groups.append((r + r0, r + r1))
            group_u.append(u)
        r += len(probes)
        gstart.append(len(groups))
    gstart = torch.tensor(gstart, dtype=torch.int64)
    t0 = torch.arange(0, sl, block_n)
    pf, pl = host_pos[t0], host_pos[torch.clamp(t0 + block_n, max=sl) - 1]
    j_lo = torch.searchsorted(s1, pf, right=True)          # first document ending after the tile's first key
    j_hi = torch.searchsorted(s0, pl, right=True)          # documents starting at or before its last key
    meets = j_lo < j_hi
    g0 = torch.where(meets, gstart[j_lo.clamp(max=len(docs))], 0)
    g1 = torch.where(meets, gstart[j_hi], 0)
    tile_groups = torch.stack([g0, g1], -1)
    max_groups = int((g1 - g0).max()) if sl else 0
    return (key_range, torch.tensor(groups, dtype=torch.int64).view(-1, 2), torch.tensor(group_u, dtype=torch.int64),
            tile_groups, max_groups)


def _fused_document_lines(probe, k, k_pos, lo, hi, lse, tables, scale: float, bs: int, col, slash) -> None:
    """Pass 2 of the fused per-document scores for one stream: adds the probes' line scores to ``col
    [hq, S_local]`` and ``slash [hq, S/bs]`` (fp64), launching groups of slots so that the fp32
    per-slot column sums stay within ``_LOGIT_BUDGET`` elements."""
    from .triton.estimator import document_probe_column_sums, tile_sizes

    _, groups, group_u, tile_groups, max_groups = tables
    hq, sl = col.shape
    if max_groups == 0 or sl == 0:
        return
    dev = col.device
    block_n = tile_sizes(probe.dtype)[1]
    tg, u_of = tile_groups.to(dev), group_u.to(dev)
    key_tile = torch.arange(sl, device=dev) // block_n
    k_blk = k_pos // bs
    chunk = max(1, min(max_groups, _LOGIT_BUDGET // max(1, hq * sl)))
    for slot0 in range(0, max_groups, chunk):
        nslot = min(chunk, max_groups - slot0)
        colu = document_probe_column_sums(probe, k, k_pos, lo, hi, lse, groups, tile_groups, slot0, nslot, scale)
        colu = colu.to(torch.float64)                                         # [hq, nslot, sl]
        col += colu.sum(1)
        gi = tg[key_tile, 0][None, :] + slot0 + torch.arange(nslot, device=dev)[:, None]   # [nslot, sl]
        real = gi < tg[key_tile, 1][None, :]
        u = u_of[gi.clamp(max=max(0, u_of.numel() - 1))]
        # slots past a tile's groups and future keys (u < k_blk) carry exactly zero; the index stays valid
        diag = torch.where(real, u - k_blk[None, :], 0).clamp(min=0)
        slash.index_add_(-1, diag.reshape(-1), colu.reshape(hq, -1))


def _document_probe_scores(q, k, layout: Layout, group, rank: int, cp: int, S: int, bs: int, L: int, nb: int,
                           scale: float, share_kv_group: bool, documents, fused: bool = False):
    """Steps 1-3 with per-document probes (``VerticalSlashConfig.probes="document"``):
    ``(col [b, h, S_local], slash [b, h, S/bs] all-reduced, k_pos [S_local], n_real [b])``.

    Each stream is scored on its own (its probes sit at other positions than another stream's), and
    each document's probes only against this rank's keys of that document (``positions`` ascend, so
    they are one local run, found on the host): the work is the documents' probes times their own
    lengths, not times the stream. One ``lse`` merge across the CP group per stream. ``fused``: the
    Triton kernels :func:`~megatron_mtraining.patterns.triton.estimator.document_probe_stats` and
    ``document_probe_column_sums`` (fp32 scores, host-built tables); else fp64 torch per document."""
    b, _, hq, _ = q.shape
    dev, f64 = q.device, torch.float64
    k_pos = layout.positions(rank, S, device=dev)
    host_pos = layout.positions(rank, S)
    col = torch.zeros((b, hq, k.shape[1]), dtype=f64, device=dev)
    slash = torch.zeros((b, hq, nb), dtype=f64, device=dev)
    n_real = []
    for i, docs in enumerate(_document_probe_spans(documents, L)):
        pos = [t for _, _, probes in docs for t in probes]
        n_real.append(len(pos))
        if not pos:                        # a stream of padding only (known on every rank): zero scores
            continue
        pos_h = torch.tensor(pos, dtype=torch.int64)
        host = [pos_h, *_row_owners(layout, rank, S, pos_h)]
        if fused:
            from .triton.estimator import document_probe_stats, tile_sizes

            tables = _document_probe_tables(docs, host_pos, bs, *tile_sizes(q.dtype))
            host += tables[:4]
        on_dev = _to_device(dev, *host)                  # one asynchronous copy of the stream's index tables
        pos_t, slots, locs = on_dev[:3]
        probe = _gather_rows(q[i], group, cp, slots, locs, len(pos))[None]          # [1, P, hq, d]
        lo, hi = documents.lo[i:i + 1, pos_t], documents.hi[i:i + 1, pos_t]
        if fused:
            tables = (*on_dev[3:], tables[4])
            m, z = document_probe_stats(probe[0], k[i], k_pos, lo[0], hi[0], tables[0], scale)
            lse = _global_lse(m[None], z[None], group, cp)[0]                           # [hq, P]
            _fused_document_lines(probe[0], k[i], k_pos, lo[0], hi[0], lse, tables, scale, bs, col[i], slash[i])
            continue
        parts, m, z, r, cached = [], [], [], 0, 0
        for s0, s1, probes in docs:
            r0, r = r, r + len(probes)
            a, e = (int(x) for x in torch.searchsorted(host_pos, torch.tensor([s0, s1])))
            rows = slice(r0, r)
            if a == e:                     # none of the document's keys on this rank
                m.append(torch.full((1, hq, r - r0), float("-inf"), dtype=f64, device=dev))
                z.append(torch.zeros((1, hq, r - r0), dtype=f64, device=dev))
                continue
            # the logits are kept for the line scores while all documents' together fit the budget
            size = hq * (r - r0) * (e - a)
            keep = cached + size <= _LOGIT_BUDGET
            cached += size if keep else 0
            spans, logits = _torch_logits(probe[:, rows], k[i:i + 1, a:e], k_pos[a:e], S, bs, scale,
                                          bounds=(lo[:, rows], hi[:, rows]), cache=keep)
            dm, dz = _torch_stats(spans, logits, (1, hq, r - r0), dev)
            m.append(dm)
            z.append(dz)
            parts.append((rows, a, e, spans, logits, _query_block_runs(probes.start, probes.stop, bs)))
        lse = _global_lse(torch.cat(m, -1), torch.cat(z, -1), group, cp)               # [1, hq, P]
        for rows, a, e, spans, logits, q_blocks in parts:
            _torch_lines(spans, logits, lse[..., rows], k_pos[a:e], q_blocks, col[i:i + 1, :, a:e],
                         slash[i:i + 1], bs)
    if share_kv_group:
        col, slash = _group_mean(col, k.shape[2]), _group_mean(slash, k.shape[2])
    slash = _all_reduce(slash, dist.ReduceOp.SUM, group, cp, "the slash scores")
    return col, slash, k_pos, _to_device(dev, torch.tensor(n_real, dtype=torch.int64))[0].to(f64)


def _gather_probe_queries(q: torch.Tensor, layout: Layout, group, rank: int, cp: int, seq_len: int,
                          last_q: int) -> torch.Tensor:
    """``[b, last_q, hq, d]``: the queries at global positions ``S - last_q .. S - 1`` on every rank.

    The owner map is host arithmetic on Python ints (no tensor is read, so nothing waits for the
    device); runs of consecutive rows are sliced (no index tensor copied to the device, which on
    CUDA synchronizes). One owner holding every probe (striped with granularity >= last_q, zigzag,
    cp 1): its rows are the result (a view of ``q`` when contiguous)."""
    b, _, hq, d = q.shape
    rows_of = {}                                      # owner -> (probe slots, local rows), ascending
    for i, t in enumerate(range(seq_len - last_q, seq_len)):
        o, loc = layout.global_to_local(t, seq_len)
        slots, locs = rows_of.setdefault(int(o), ([], []))
        slots.append(i)
        locs.append(int(loc))

    def rows(idx: list):                    # a slice when idx is a run of consecutive integers
        i0 = idx[0]
        return slice(i0, i0 + len(idx)) if idx == list(range(i0, i0 + len(idx))) \
            else torch.tensor(idx, dtype=torch.long).to(q.device)

    parts = []
    for o in sorted(rows_of):                         # sorted: same order on every rank
        sel, loc = rows_of[o]
        if o == rank:
            r = rows(loc)
            buf = (q[:, r] if isinstance(r, slice) else q.index_select(1, r)).contiguous()
        else:
            buf = torch.empty((b, len(sel), hq, d), dtype=q.dtype, device=q.device)
        if cp > 1:
            with comm_context(f"vertical-slash estimator: broadcast of the probe queries of group rank {o}", group):
                dist.broadcast(buf, src=dist.get_global_rank(group, o), group=group)
        parts.append((sel, buf))
    if len(parts) == 1:                               # sel == arange(last_q)
        return parts[0][1]
    out = torch.empty((b, last_q, hq, d), dtype=q.dtype, device=q.device)
    for sel, buf in parts:
        out[:, rows(sel)] = buf
    return out


def _all_reduce(t: torch.Tensor, op, group, cp: int, what: str) -> torch.Tensor:
    if cp > 1:
        with comm_context(f"vertical-slash estimator: all_reduce of {what}", group):
            dist.all_reduce(t, op=op, group=group)
    return t


_IMPLS = ("auto", "torch", "triton")


def resolve_impl(impl: str, q: torch.Tensor, k: torch.Tensor) -> str:
    """The score implementation :func:`estimate_vertical_slash` runs for ``impl`` on these inputs.

    Args:
        impl: ``"auto"``, ``"torch"`` or ``"triton"``.
        q, k: the estimator's ``q`` and ``k`` (only device and dtype are read).

    Returns:
        ``"torch"`` or ``"triton"`` (``"auto"``: ``"triton"`` for CUDA bf16/fp16/fp32 inputs of one
        dtype when Triton imports, else ``"torch"``).

    Raises:
        ValueError: an unknown ``impl`` (naming the allowed ones), or ``"triton"`` where the kernels
            cannot run (fp64 or mixed dtypes, Triton missing, CPU without ``TRITON_INTERPRET=1``).
    """
    if impl not in _IMPLS:
        raise ValueError(f"estimate_vertical_slash: impl must be one of {', '.join(map(repr, _IMPLS))}, got {impl!r}")
    if impl == "torch":
        return "torch"
    ok_dtype = q.dtype == k.dtype and q.dtype in TRITON_DTYPES
    if impl == "auto":
        return "triton" if q.is_cuda and ok_dtype and triton_runs_on(q.device) else "torch"
    if not ok_dtype:
        raise ValueError(f"estimate_vertical_slash(impl='triton') needs q and k of one dtype among bf16/fp16/fp32, "
                         f"got {q.dtype} and {k.dtype} (use impl='torch')")
    if not triton_runs_on(q.device):
        raise ValueError(f"estimate_vertical_slash(impl='triton') cannot run on {q.device}: it needs Triton and a "
                         "CUDA tensor, or a CPU tensor with TRITON_INTERPRET=1 set before triton is imported")
    return "triton"


def _global_lse(m: torch.Tensor, z: torch.Tensor, group, cp: int) -> torch.Tensor:
    """fp64 ``[b, hq, L]`` log-sum-exp of the probe rows over the CP group from the local row max
    ``m`` and ``z = sum exp(s - m)``: ``all_reduce(MAX)`` then a rescaled ``all_reduce(SUM)``."""
    gm = _all_reduce(m.clone(), dist.ReduceOp.MAX, group, cp, "the probe row max") if cp > 1 else m
    gsafe = torch.where(torch.isneginf(gm), 0.0, gm)
    # cp 1: gm == m, so the rescale factor exp(m - gsafe) is exactly 1 (finite m) or multiplies a
    # zero sum (m = -inf: no visible key); for m = +inf / NaN both z and the product are NaN, which
    # the where below maps to 1 -- the same lse bits either way
    gz = _all_reduce(z * torch.exp(m - gsafe), dist.ReduceOp.SUM, group, cp,
                     "the probe row sum") if cp > 1 else z
    return gsafe + torch.log(torch.where(gz > 0, gz, 1.0))


def _torch_logits(probe, k, k_pos, S: int, bs: int, scale: float, bounds=None, cache: bool = True):
    """``(spans, logits)`` of the fp64 torch score path: ``logits(j0, j1)`` is ``[b, hq, L, j1 - j0]``
    scaled logits of the probes against keys ``j0:j1`` (``-inf`` where invisible: causal for the
    stream's last ``L`` queries, or outside ``bounds = (lo, hi)`` ``[b, L]``); ``spans`` chunk the keys so
    that one block stays under ``_LOGIT_BUDGET`` elements (cached when there is one chunk and ``cache``)."""
    b, L, hq, d = probe.shape
    sl, hkv = k.shape[1], k.shape[2]
    rep, dev, f64 = hq // hkv, probe.device, torch.float64
    pq = probe.to(f64).view(b, L, hkv, rep, d)
    p_pos = torch.arange(S - L, S, device=dev)
    chunk = max(bs, (_LOGIT_BUDGET // max(1, b * hq * L)) // bs * bs)
    spans = [(j, min(sl, j + chunk)) for j in range(0, sl, chunk)]
    keep = {} if cache and len(spans) == 1 else None

    def logits(j0: int, j1: int) -> torch.Tensor:
        if keep and (j0, j1) in keep:
            return keep[(j0, j1)]
        s = torch.einsum("bqgrd,bkgd->bgrqk", pq, k[:, j0:j1].to(f64)).reshape(b, hq, L, j1 - j0) * scale
        if bounds is None:
            s.masked_fill_(k_pos[None, j0:j1] > p_pos[:, None], float("-inf"))
        else:
            t = k_pos[None, None, j0:j1]
            s.masked_fill_(((t < bounds[0][..., None]) | (t > bounds[1][..., None]))[:, None], float("-inf"))
        if keep is not None:
            keep[(j0, j1)] = s
        return s

    return spans, logits


def _torch_stats(spans, logits, shape, dev):
    """Local ``(m, z)`` ``[b, hq, L]`` fp64 of the probe rows over the keys of ``spans`` (row max, rescaled sum)."""
    m = torch.full(shape, float("-inf"), dtype=torch.float64, device=dev)
    z = torch.zeros(shape, dtype=torch.float64, device=dev)
    for j0, j1 in spans:
        s = logits(j0, j1)
        new_m = torch.maximum(m, s.amax(-1))
        safe = torch.where(torch.isneginf(new_m), torch.zeros_like(new_m), new_m)
        z = z * torch.exp(m - safe) + torch.exp(s - safe[..., None]).sum(-1)
        m = new_m
    return m, z


def _torch_lines(spans, logits, lse, k_pos, q_blocks, col, slash, bs: int) -> None:
    """Adds the line scores of the probes to ``col [b, hq, keys]`` (per key of ``spans``) and ``slash
    [b, hq, S/bs]`` (per block diagonal; ``q_blocks``: ``(u, r0, r1)`` probe rows ``r0:r1`` in global
    query block ``u``), given the probes' global ``lse``."""
    for j0, j1 in spans:
        p = torch.exp(logits(j0, j1) - lse[..., None])                  # [b, hq, L, c]
        col[..., j0:j1] += p.sum(-2)
        k_blk = k_pos[j0:j1] // bs
        for u, r0, r1 in q_blocks:
            pu = p[:, :, r0:r1].sum(-2)                                  # [b, hq, c]
            # future keys (k_blk > u) carry exactly zero probability; clamp keeps the index valid
            slash.index_add_(-1, (u - k_blk).clamp(min=0), pu)


def _torch_scores(probe, k, k_pos, q_blocks, S: int, bs: int, scale: float, group, cp: int, bounds=None):
    """fp64 torch scores (oracle path, chunked over keys): ``col [b, hq, S_local]`` and this rank's
    ``slash [b, hq, S/bs]`` (before its all_reduce). ``bounds``: packed documents' key bounds
    ``(lo, hi)`` ``[b, L]`` of the probes (key ``t`` visible iff ``lo <= t <= hi``), or ``None``."""
    b, L, hq, _ = probe.shape
    dev = probe.device
    spans, logits = _torch_logits(probe, k, k_pos, S, bs, scale, bounds)
    # --- exact softmax rows of the probes across the CP group: max, then rescaled sums
    m, z = _torch_stats(spans, logits, (b, hq, L), dev)
    lse = _global_lse(m, z, group, cp)
    # --- line scores: token-level columns (local), block-level diagonals (global after all_reduce)
    col = torch.zeros((b, hq, k.shape[1]), dtype=torch.float64, device=dev)
    slash = torch.zeros((b, hq, S // bs), dtype=torch.float64, device=dev)
    _torch_lines(spans, logits, lse, k_pos, q_blocks, col, slash, bs)
    return col, slash


def _group_mean(scores: torch.Tensor, hkv: int) -> torch.Tensor:
    """``share_pattern="kv_group"``: the mean of ``[b, hq, n]`` line scores over the query heads of
    each GQA group (query head ``h`` in group ``h // (hq / hkv)``), ``[b, hkv, n]`` fp64. Each
    head's probe rows are softmax-normalised (mass ``last_q`` per head), so the mean keeps the
    total mass ``last_q`` and the recall target ``recall * last_q`` of the selection."""
    b, hq, n = scores.shape
    return scores.to(torch.float64).view(b, hkv, hq // hkv, n).mean(2)


# ----------------------------------------------------------------------------------- estimator
@torch.no_grad()
def estimate_vertical_slash(q: torch.Tensor, k: torch.Tensor, *, layout: Layout, group=None,
                            config: VerticalSlashConfig = VerticalSlashConfig(),
                            softmax_scale: Optional[float] = None, impl: str = "auto",
                            static_widths: Optional[bool] = None, documents=None) -> VerticalSlashPattern:
    """Estimate the global vertical-slash pattern of this forward pass (identical on every rank).

    Args:
        q: ``[b, s_local, hq, d]`` this rank's queries (position-encoded), any float dtype.
        k: ``[b, s_local, hkv, d]`` this rank's keys (GQA: query head ``h`` reads kv head
            ``h // (hq // hkv)``).
        layout: the CP layout the shards follow; ``layout.cp_size`` must equal the group size.
        group: the CP process group (``None``: one rank, no communication).
        config: budgets (:class:`VerticalSlashConfig`).
        softmax_scale: defaults to ``1/sqrt(d)`` (must be the attention's scale).
        impl: how the scores (probe softmax, column and block-diagonal sums) are computed:
            ``"torch"``: fp64 torch (the oracle; any device and float dtype);
            ``"triton"``: the fused kernels of :mod:`megatron_mtraining.patterns.triton.estimator`
            (fp32 scores from bf16/fp16/fp32 inputs; CUDA, or CPU under ``TRITON_INTERPRET=1``);
            ``"auto"`` (default): ``"triton"`` for CUDA bf16/fp16/fp32 inputs when Triton imports,
            else ``"torch"``. The selection runs in torch (fp64 budgets), or with ``"triton"`` and static
            widths in the Triton selection kernel (:mod:`megatron_mtraining.patterns.triton.select`:
            the slash lines at any cp, the columns at cp 1; the same lines except where the target
            lies within the rounding of an fp64 sum, see that module).
        static_widths: pad ``slash`` to ``min(S / block_size, max_slash)`` and ``vertical`` to
            ``min(candidates, max_vertical)`` entries (the caps: known on the host, so the
            estimator reads nothing back from the device) instead of the largest count (one host
            sync). The selected lines are the same; only the amount of ``-1`` padding differs.
            ``None`` (default): static on CUDA (a host sync stalls the launch queue), the largest
            count elsewhere.
        documents: packed documents (:class:`~megatron_mtraining.layout.PackedDocuments` of the
            global sequence) or ``None``. With a document mask the probes (still the stream's last
            ``last_q`` queries) score only keys of their own documents (padding probes score
            nothing), the recall target is ``recall`` times the number of real probes of the
            stream, the vertical floors are the first ``sink_tokens`` tokens of *every* document
            (the cap ``max_vertical`` is raised to their number where they exceed it); both score
            paths apply the document bounds (the Triton kernels skip key tiles that no probe sees).

    Returns:
        :class:`VerticalSlashPattern` on ``q.device``; every rank of the group returns the same.
        One entry per query head (``[b, hq, ...]``) with ``config.share_pattern="head"``; one per
        KV head (``[b, hkv, ...]``, shared by query heads ``g * hq/hkv .. (g+1) * hq/hkv - 1``) with
        ``"kv_group"``: the column and block-diagonal scores (step 3) of the group's query heads,
        each from its own softmax-normalised probe rows, are averaged (fp64) before the budgets and
        the selection (steps 4-5), which then run once per KV head; the recall target applies to
        the group's mean mass (``est_*_mass`` report it).

    Raises:
        ValueError: shape mismatch, ``layout.cp_size`` not the group size, a sequence the layout
            cannot split, ``S % block_size != 0`` or ``S < last_q``; an unknown ``impl``, or
            ``impl="triton"`` where the kernels cannot run (Triton missing, fp64 or mixed dtypes,
            CPU without ``TRITON_INTERPRET=1``); packed documents that do not describe ``b``
            streams of ``S`` tokens.
    """
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q [b, s, hq, d] and k [b, s, hkv, d] expected, got {tuple(q.shape)}, {tuple(k.shape)}")
    b, sl, hq, d = q.shape
    hkv = k.shape[2]
    if hq % hkv:
        raise ValueError(f"GQA needs num query heads ({hq}) divisible by num kv heads ({hkv})")
    cp, rank = group_size(group), group_rank(group)
    if layout.cp_size != cp:
        raise ValueError(f"layout.cp_size={layout.cp_size} but the process group has {cp} ranks")
    S = sl * cp
    layout.check_seq_len(S)
    bs, L = config.block_size, config.last_q
    if S % bs:
        raise ValueError(f"sequence length {S} must be a multiple of VerticalSlashConfig.block_size={bs}")
    if L > S:
        raise ValueError(f"VerticalSlashConfig.last_q={L} exceeds the sequence length {S}")
    if documents is not None and documents.single_document:
        documents = None                              # plain causal attention: the unpacked path, bitwise
    if documents is not None and (documents.seq_len != S or documents.batch_size != b):
        raise ValueError(f"packed documents describe {documents.batch_size} streams of {documents.seq_len} "
                         f"tokens but q has batch {b} and sequence length {S}")
    fused = resolve_impl(impl, q, k) == "triton"
    nb = S // bs
    scale = resolve_softmax_scale(softmax_scale, d)
    check_softmax_scale(scale, "estimate_vertical_slash")

    static = q.is_cuda if static_widths is None else bool(static_widths)
    per_document = documents is not None and config.probes == "document"
    n_real = None
    with record_function(REGION_ESTIMATOR_SCORES):
        if per_document:
            col, slash, k_pos, n_real = _document_probe_scores(q, k, layout, group, rank, cp, S, bs, L, nb, scale,
                                                               config.share_pattern == "kv_group", documents,
                                                               fused=fused)
        else:
            col, slash, k_pos = _scores(q, k, layout, group, rank, cp, S, bs, L, nb, scale, fused,
                                        share_kv_group=config.share_pattern == "kv_group", documents=documents)
    with record_function(REGION_ESTIMATOR_SELECTION):
        gather = None if cp == 1 else (lambda score, pos: _all_gather_candidates(score, pos, group, cp))
        if documents is not None:
            return _select_documents(slash, col, k_pos, S, L, config, gather, documents, n_real=n_real)
        return _select(slash, col, k_pos, layout, rank, S, L, config, gather, static_widths=static, fused=fused)


def _scores(q, k, layout: Layout, group, rank: int, cp: int, S: int, bs: int, L: int, nb: int, scale: float,
            fused: bool, share_kv_group: bool = False, documents=None):
    """Steps 1-3 of the module docstring: ``(col [b, hq, S_local], slash [b, hq, S/bs] all-reduced fp64,
    k_pos [S_local])``; with ``share_kv_group`` both averaged over each GQA group first (``[b, hkv, ...]``,
    :func:`_group_mean`)."""
    b, _, hq, _ = q.shape
    dev, f64 = q.device, torch.float64
    k_pos = layout.positions(rank, S, device=dev)                       # ascending
    probe = _gather_probe_queries(q, layout, group, rank, cp, S, L)      # [b, L, hq, d]
    q_blocks = _query_block_runs(S - L, S, bs)

    bounds = None if documents is None else (documents.lo[:, S - L:], documents.hi[:, S - L:])
    if fused:
        from .triton.estimator import probe_column_sums, probe_softmax_lse, probe_softmax_stats, slash_sums

        kp32 = k_pos.to(torch.int32)          # the kernels' key positions, converted once for both passes
        # --- exact softmax rows of the probes across the CP group: local (m, z) from the kernel
        # (cp 1: the lse itself, merged in the same launch)
        if cp == 1:
            lse = probe_softmax_lse(probe, k, kp32, S, scale, bounds=bounds)
        else:
            m, z = probe_softmax_stats(probe, k, kp32, S, scale, bounds=bounds)
            lse = _global_lse(m, z, group, cp)
        # --- line scores: per-key sums split by probe query block (fp32), cast to fp64
        colu32 = probe_column_sums(probe, k, kp32, S, lse, scale, bs, bounds=bounds)   # [b, hq, nu, sl]
        assert colu32.shape[2] == len(q_blocks)
        if cp == 1 and len(q_blocks) == 1:
            # one query block, every key local in order: the column scores are fp32 values (the
            # selection sorts them as fp32; fp64 copies are the same numbers: same order, ties
            # included) and each diagonal sums one key block, in one launch
            col = colu32[:, :, 0]
            slash = slash_sums(col, q_blocks[0][0], nb, bs)
        else:
            colu = colu32.to(f64)
            col = colu32[:, :, 0] if colu.shape[2] == 1 else colu.sum(2)
            slash = torch.zeros((b, hq, nb), dtype=f64, device=dev)
            k_blk = k_pos // bs
            for i, (u, _, _) in enumerate(q_blocks):
                # future keys (k_blk > u) carry exactly zero probability; clamp keeps the index valid
                slash.index_add_(-1, (u - k_blk).clamp(min=0), colu[:, :, i])
    else:
        col, slash = _torch_scores(probe, k, k_pos, q_blocks, S, bs, scale, group, cp, bounds=bounds)
    if share_kv_group:
        col, slash = _group_mean(col, k.shape[2]), _group_mean(slash, k.shape[2])
    slash = _all_reduce(slash, dist.ReduceOp.SUM, group, cp, "the slash scores")
    return col, slash, k_pos
