"""FlashAttention-4 (``flash-attn-4``, CuTe DSL) kernels for dense attention and dense ring steps.

FlashAttention-4 runs on Hopper (SM90) and Blackwell (SM100) GPUs. It is an optional dependency
(``pip install megatron_mtraining[fa4]``); nothing here imports it until a kernel runs, so the
package imports and runs without it (CPU, CI, other GPUs).

Two uses:

* **CP=1 dense attention**: :func:`fa4_attention`, causal softmax attention with autograd.
* **Sparse ring steps** (MTraining §3.3, vertical-slash): the slash blocks of a step whose pattern
  was estimated at 128-token blocks (``vertical_slash.block_size: 128``, striped granularity a
  multiple of 128) run through FA4's block sparsity, per batch and query head
  (:func:`sparsity_from_indices`, pure); the token-level vertical columns run the Triton column
  kernels; the two partial results are merged by LSE (:class:`FA4SparseStepKernel`).
* **Packed documents at CP=1** (a document mask, :class:`~megatron_mtraining.layout.PackedDocuments`):
  :func:`fa4_varlen_attention` runs FA4's varlen interface (``flash_attn_varlen_func`` with
  ``cu_seqlens``): the ``b`` streams of ``S`` tokens are flattened into one THD batch
  ``[total, h, d]`` of the documents' real tokens (:func:`varlen_layout`, pure; the offsets of
  ``PackedDocuments`` already run over the rows concatenated), every document its own causal
  sequence, and the result is put back in ``[b, S, h, d]`` with exact zeros at padding tokens
  (LSE ``-inf``), whose gradients are then exact zeros too. Without padding the flattening is a
  view. The dense ring steps at CP > 1 keep the Triton kernels for packed documents: a step's
  document mask on striped or zigzag shards is a token-level mask on global positions, which FA4's
  varlen causal mask (local indices) cannot express and its varlen backward cannot combine with
  block sparsity.
* **Dense ring steps** (MTraining §3.3, the striped ring's per-step work): every step of the dense
  ring is attention of the local queries over one owner's keys, masked by *global* positions (a
  key is visible iff ``k_pos <= q_pos``). :func:`plan_step` classifies each 128×128 tile of a step
  from the positions alone: a tile is *full* (every key visible to every query), *empty*, or
  *partial*. A step whose tiles are all full or empty maps exactly onto FA4's block sparsity with
  full blocks only; a step whose query and key positions are the same runs FA4's own causal mask.
  That covers the striped layout at granularity 128 (steps with ``owner < rank`` are block-causal
  inclusive, ``owner > rank`` strict, ``owner == rank`` causal) and the zigzag layout with chunks
  that are multiples of 128. Any other step (e.g. striped granularity 64, whose 128-tiles mix two
  stripes) is reported as unsupported and the caller keeps another kernel.

Shapes follow flash-attn's bshd convention: q ``[b, sq, hq, d]``, k/v ``[b, sk, hkv, d]``
(GQA: ``hq % hkv == 0``), out ``[b, sq, hq, d]``, lse ``[b, hq, sq]`` fp32, natural log. Inputs
are bf16 or fp16, contiguous in the last dimension, on one CUDA device.

The backward takes the *final* ``out`` and ``lse`` of the whole ring (FA4 derives
``delta = rowsum(dout * out)`` from them), the way ring libraries call FlashAttention.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..common import acc_dtype, cuda_index
from ..patterns.indices import packed_index_lists
from .merge import merge_attention_fast
from .sparse_reference import SparseStepKernel

__all__ = [
    "FA4_BLOCK",
    "FA4_CAPTURE_RULE",
    "BlockSparsity",
    "StepPlan",
    "classify_tiles",
    "block_sparsity_from_tiles",
    "plan_step",
    "sparsity_from_indices",
    "with_backward_lists",
    "fa4_unavailable_reason",
    "fa4_shape_problem",
    "fa4_forward",
    "fa4_backward",
    "fa4_attention",
    "fa4_causal",
    "FA4DenseStepKernel",
    "make_fa4_dense_step",
    "FA4SparseStepKernel",
    "make_fa4_sparse_step",
    "fa4_self_check",
    "VarlenLayout",
    "varlen_layout",
    "varlen_layout_of",
    "varlen_token_index",
    "flatten_thd",
    "unflatten_thd",
    "unflatten_lse",
    "varlen_reference",
    "fa4_varlen_attention",
    "fa4_packed_causal",
    "fa4_varlen_self_check",
]

#: Tile of FA4's block sparsity used here (its SM90 backward needs 128-wide KV blocks).
FA4_BLOCK = 128

#: Tile classes returned by :func:`classify_tiles`.
EMPTY, FULL, PARTIAL = 0, 1, 2


@dataclass(frozen=True)
class BlockSparsity:
    """FA4 block-sparse metadata of one step, full blocks only, broadcast over batch and heads.

    Attributes:
        fwd_cnt: ``[1, 1, M]`` int32, visible key blocks per query block.
        fwd_idx: ``[1, 1, M, max(1, max fwd_cnt)]`` int32, their indices, ascending, packed left.
        bwd_cnt: ``[1, 1, N]`` int32, query blocks that see each key block (``None`` in lists built
            for the forward only: :func:`sparsity_from_indices` with ``backward=False``).
        bwd_idx: ``[1, 1, N, max(1, max bwd_cnt)]`` int32, their indices, ascending, packed left
            (``None`` with ``bwd_cnt``).
        empty_rows: ``[M]`` bool, query blocks that see no key (their out is 0, lse ``-inf``).
        tiles: number of computed 128×128 tiles.
    """

    fwd_cnt: torch.Tensor
    fwd_idx: torch.Tensor
    bwd_cnt: Optional[torch.Tensor]
    bwd_idx: Optional[torch.Tensor]
    empty_rows: torch.Tensor
    tiles: int

    def to(self, device) -> "BlockSparsity":
        def move(t):
            return None if t is None else t.to(device)
        return BlockSparsity(self.fwd_cnt.to(device), self.fwd_idx.to(device), move(self.bwd_cnt),
                             move(self.bwd_idx), self.empty_rows.to(device), self.tiles)


@dataclass(frozen=True)
class StepPlan:
    """How FA4 runs one ring step.

    ``kind`` is ``"none"`` (no visible key: the step is skipped), ``"causal"`` (FA4's causal mask on
    local indices), ``"full"`` (no mask), ``"blocks"`` (block sparsity, ``sparsity`` set) or
    ``"unsupported"`` (a tile is partially visible; ``reason`` says which).
    """

    kind: str
    sparsity: Optional[BlockSparsity] = None
    reason: str = ""


def _block_ranges(pos: torch.Tensor, block: int):
    p = pos.view(-1, block)
    return p.min(dim=1).values, p.max(dim=1).values


def classify_tiles(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool = True,
                   block: int = FA4_BLOCK) -> torch.Tensor:
    """Class of every ``block × block`` tile of a step under the positional causal mask.

    Args:
        q_pos: ``[sq]`` int64 global positions of the queries (``sq % block == 0``).
        k_pos: ``[sk]`` int64 global positions of the keys (``sk % block == 0``).
        causal: key visible iff ``k_pos <= q_pos``; ``False``: every key visible.

    Returns:
        ``[sq // block, sk // block]`` int8: ``EMPTY`` (0), ``FULL`` (1) or ``PARTIAL`` (2).

    Raises:
        ValueError: a length that is not a multiple of ``block``.
    """
    if q_pos.numel() % block or k_pos.numel() % block:
        raise ValueError(f"FA4 tiles need lengths that are multiples of {block}: got sq={q_pos.numel()}, "
                         f"sk={k_pos.numel()}")
    m, n = q_pos.numel() // block, k_pos.numel() // block
    if not causal:
        return torch.full((m, n), FULL, dtype=torch.int8, device=q_pos.device)
    q_min, q_max = _block_ranges(q_pos, block)
    k_min, k_max = _block_ranges(k_pos, block)
    full = k_max[None, :] <= q_min[:, None]
    empty = k_min[None, :] > q_max[:, None]
    out = torch.full((m, n), PARTIAL, dtype=torch.int8, device=q_pos.device)
    out[full] = FULL
    out[empty] = EMPTY
    return out


def _packed_lists(mask: torch.Tensor):
    """Row-wise ascending column indices of ``mask`` (``[R, C]`` bool), packed left, int32."""
    return packed_index_lists(mask, fill=0)


def block_sparsity_from_tiles(full: torch.Tensor) -> BlockSparsity:
    """FA4 forward and backward block lists of a ``[M, N]`` bool map of full tiles.

    The forward lists, per query block, the key blocks to compute; the backward lists, per key
    block, the query blocks (FA4's transposed layout). Both are ascending and packed left; unused
    entries are 0 and never read (FA4 reads ``cnt`` entries per row).
    """
    full = full.bool()
    fwd_cnt, fwd_idx = _packed_lists(full)
    bwd_cnt, bwd_idx = _packed_lists(full.t())
    return BlockSparsity(fwd_cnt[None, None], fwd_idx[None, None], bwd_cnt[None, None], bwd_idx[None, None],
                         fwd_cnt == 0, int(full.sum()))


def plan_step(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool = True,
              block: int = FA4_BLOCK) -> StepPlan:
    """Choose how FA4 computes one ring step (module docstring).

    Pure: decided from the positions alone, on their device, with one host read of the tile map.
    """
    if q_pos.numel() % block or k_pos.numel() % block:
        return StepPlan("unsupported", reason=f"local lengths {q_pos.numel()}/{k_pos.numel()} are not multiples "
                                              f"of FA4's {block}-token tile")
    if not causal:
        return StepPlan("full")
    if q_pos.shape == k_pos.shape and bool(torch.equal(q_pos, k_pos)):
        return StepPlan("causal")
    tiles = classify_tiles(q_pos, k_pos, causal, block)
    if bool((tiles == PARTIAL).any()):
        return StepPlan("unsupported", reason=f"a {block}x{block} tile is partially visible (token-level mask; "
                                              f"striped layouts need granularity a multiple of {block})")
    full = tiles == FULL
    if not bool(full.any()):
        return StepPlan("none")
    if bool(full.all()):
        return StepPlan("full")
    return StepPlan("blocks", block_sparsity_from_tiles(full))


#: Largest ``b * hq * M * N`` (query blocks × key blocks of one step) for which the backward block
#: lists are built at full width without reading their maximum on the host.
_FULL_WIDTH_LIMIT = 1 << 26


def sparsity_from_indices(idx, backward: bool = True) -> BlockSparsity:
    """FA4 block lists of the slash blocks of one sparse ring step, per batch and query head.

    Args:
        idx: a :class:`~megatron_mtraining.patterns.indices.StepIndices` with ``block_size`` equal to
            :data:`FA4_BLOCK` (its columns are ignored: they run elsewhere).
        backward: also build the backward (per key block) lists; ``False`` leaves ``bwd_cnt`` and
            ``bwd_idx`` ``None`` (the forward needs only the forward lists; the backward lists of a
            128K step take ``b * hq * M * M`` int32, 38 MB at 9 heads).

    Returns:
        a :class:`BlockSparsity` with ``fwd_cnt [b, hq, M]`` (``idx.block_count``), ``fwd_idx
        [b, hq, M, W]`` (``idx.block_index``, padding replaced by 0), ``bwd_cnt [b, hq, N]`` and
        ``bwd_idx [b, hq, N, W']`` (per key block, the query blocks that list it, ascending, packed
        left), ``empty_rows [b, hq, M]`` and ``tiles = -1`` (not counted: that would read the device).
        ``M = N = s_local / 128``. Built on the device of ``idx`` without a host read when
        ``b * hq * M * N <= 2**26`` (``W' = M``); larger steps read the widest backward list once.

    Raises:
        ValueError: ``idx.block_size != 128``.
    """
    if idx.block_size != FA4_BLOCK:
        raise ValueError(f"FA4 block sparsity needs {FA4_BLOCK}-token blocks, got block_size {idx.block_size}")
    cnt = idx.block_count.to(torch.int32)
    w = idx.block_index.shape[-1]
    valid = torch.arange(w, device=cnt.device) < cnt[..., None].long()                # [b, h, M, W]
    fwd_idx = torch.where(valid, idx.block_index, torch.zeros_like(idx.block_index)).to(torch.int32).contiguous()
    sp = BlockSparsity(cnt.contiguous(), fwd_idx, None, None, cnt == 0, -1)
    return with_backward_lists(sp) if backward else sp


def with_backward_lists(sp: BlockSparsity) -> BlockSparsity:
    """``sp`` (lists of :func:`sparsity_from_indices`, ``fwd_cnt [b, hq, M]``) with its backward lists
    built from its forward lists: ``bwd_cnt [b, hq, N]`` and ``bwd_idx [b, hq, N, W']``, per key block
    the query blocks that list it, ascending, packed left (``N = M``). Built on the lists' device
    without a host read when ``b * hq * M * N <= 2**26`` (``W' = M``); larger steps read the widest
    backward list once. Returns ``sp`` itself when it has them already."""
    if sp.bwd_cnt is not None:
        return sp
    cnt, fwd_idx = sp.fwd_cnt, sp.fwd_idx
    b, h, m = cnt.shape
    n = m                                       # a ring step's query and key shards have the same length
    dev = cnt.device
    valid = torch.arange(fwd_idx.shape[-1], device=dev) < cnt[..., None].long()
    tile = torch.zeros(b, h, m, n + 1, dtype=torch.bool, device=dev)
    col = torch.where(valid, fwd_idx.long().clamp(0, n - 1), n)
    tile.scatter_(-1, col, True)
    tt = tile[..., :n].transpose(-1, -2)                                          # [b, h, N, M]
    bwd_cnt, bwd_idx = packed_index_lists(tt, width=m if b * h * m * n <= _FULL_WIDTH_LIMIT else None, fill=0)
    return BlockSparsity(sp.fwd_cnt, sp.fwd_idx, bwd_cnt.contiguous(), bwd_idx.contiguous(), sp.empty_rows, sp.tiles)


# ---------------------------------------------------------------------------------------------- kernels


@functools.lru_cache(maxsize=None)
def _import_error() -> Optional[str]:
    try:
        import flash_attn.cute.interface  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA/DSL error raised at import
        return f"flash-attn-4 does not import ({type(exc).__name__}: {exc})"
    return None


def fa4_unavailable_reason(device=None, dtype: Optional[torch.dtype] = None,
                           head_dim: Optional[int] = None) -> Optional[str]:
    """``None`` when FA4 can run here, else the reason (a sentence naming the rule).

    Rules: a CUDA device of compute capability 9.x or 10.x; dtype bf16 or fp16; head_dim 64, 96
    or 128 (the SM90 backward's tiles); ``flash_attn.cute`` imports.
    """
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda":
        return f"FA4 needs a CUDA device, got {dev}"
    major = torch.cuda.get_device_capability(dev)[0]
    if major not in (9, 10):
        return f"FA4 needs compute capability 9.x (Hopper) or 10.x (Blackwell), got {major}.x"
    return fa4_shape_problem(dtype, head_dim) or _import_error()


def fa4_shape_problem(dtype: Optional[torch.dtype] = None, head_dim: Optional[int] = None) -> Optional[str]:
    """The rules of :func:`fa4_unavailable_reason` that do not depend on the machine: dtype bf16 or
    fp16, head_dim 64, 96 or 128 (``None``: not checked). ``None`` when they hold, else the reason."""
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        return f"FA4 needs bf16 or fp16 inputs, got {dtype}"
    if head_dim is not None and head_dim not in (64, 96, 128):
        return f"FA4 is used for head_dim 64, 96 or 128, got {head_dim}"
    return None


def _bsparse(cnt: torch.Tensor, idx: torch.Tensor):
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    zeros_cnt = torch.zeros_like(cnt)
    zeros_idx = torch.zeros(cnt.shape + (1,), dtype=torch.int32, device=cnt.device)
    return BlockSparseTensorsTorch(mask_block_cnt=zeros_cnt, mask_block_idx=zeros_idx, full_block_cnt=cnt,
                                   full_block_idx=idx, block_size=(FA4_BLOCK, FA4_BLOCK))


def fa4_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float, causal: bool = False,
                sparsity: Optional[BlockSparsity] = None):
    """FA4 forward with its LSE.

    Args:
        q, k, v: bshd bf16/fp16 CUDA tensors (module docstring).
        softmax_scale: scale of ``q k^T``.
        causal: FA4's causal mask on local indices (query ``i`` sees keys ``<= i``).
        sparsity: full-block lists (:class:`BlockSparsity`) or ``None`` (dense).

    Returns:
        ``(out, lse)``: out ``[b, sq, hq, d]`` in q's dtype, lse ``[b, hq, sq]`` fp32. Query blocks
        with no visible key give out 0 and lse ``-inf``.
    """
    from flash_attn.cute.interface import _flash_attn_fwd
    bst = None if sparsity is None else _bsparse(sparsity.fwd_cnt, sparsity.fwd_idx)
    out, lse, *_ = _flash_attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                   block_sparse_tensors=bst, return_lse=True)
    if sparsity is not None and sparsity.empty_rows.dim() == 3:       # per-head lists: no host read
        rows = sparsity.empty_rows.repeat_interleave(FA4_BLOCK, dim=-1)          # [b, hq, sq]
        lse = lse.masked_fill(rows, float("-inf"))
        out.masked_fill_(rows.transpose(1, 2)[..., None], 0.0)                    # FA4's own buffer
    elif sparsity is not None and bool(sparsity.empty_rows.any()):
        rows = sparsity.empty_rows.repeat_interleave(FA4_BLOCK)
        out[:, rows] = 0
        lse[:, :, rows] = float("-inf")
    return out, lse


def fa4_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, *, softmax_scale: float, causal: bool = False,
                 sparsity: Optional[BlockSparsity] = None, deterministic: bool = False):
    """FA4 backward of one step against the final ``out``/``lse`` (of the whole ring).

    Returns:
        ``(dq, dk, dv)`` in q's dtype, shapes of q, k, v.
    """
    from flash_attn.cute.interface import _flash_attn_bwd
    bst = None
    if sparsity is not None:
        bst = _bsparse(sparsity.bwd_cnt, sparsity.bwd_idx)
        if deterministic:
            from flash_attn.cute.block_sparsity import compute_dq_write_order
            zf = torch.zeros_like(sparsity.fwd_cnt)
            zfi = torch.zeros(sparsity.fwd_cnt.shape + (1,), dtype=torch.int32, device=zf.device)
            zb = torch.zeros_like(sparsity.bwd_cnt)
            zbi = torch.zeros(sparsity.bwd_cnt.shape + (1,), dtype=torch.int32, device=zb.device)
            order, order_full = compute_dq_write_order(zf, zfi, sparsity.fwd_cnt, sparsity.fwd_idx,
                                                       zb, zbi, sparsity.bwd_cnt, sparsity.bwd_idx)
            bst = bst._replace(dq_write_order=order, dq_write_order_full=order_full, spt=False)
    dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal,
                                 block_sparse_tensors=bst, deterministic=deterministic)
    return dq, dk, dv


def fa4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float,
                  causal: bool = True) -> torch.Tensor:
    """Dense softmax attention through FA4 with autograd (CP=1). bshd in, ``[b, s, hq, d]`` out."""
    from flash_attn.cute import flash_attn_func
    out = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal)
    return out[0] if isinstance(out, tuple) else out


def fa4_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Causal attention at CP=1 through FA4 (the backend's ``dense_cp1``; bshd, out in q's dtype)."""
    return fa4_attention(q, k, v, softmax_scale=softmax_scale, causal=True)


class FA4DenseStepKernel:
    """Dense ring step kernel on FA4 (the ring's step-kernel protocol).

    ``forward(q, k, v, owner) -> (out fp32, lse fp32) | None`` and
    ``backward(dout, q, k, v, lse, delta, owner) -> (dq, dk, dv) fp32 | None``. The backward needs
    the ring's final ``out``: the ring hands it over with :meth:`begin_backward` (``out=`` overrides
    it). Steps that :func:`plan_step` cannot map run ``fallback`` (another kernel of the same
    protocol); :attr:`fallback_steps` counts the forward steps it ran.

    Args:
        q_pos: ``[s_local]`` global positions of this rank's queries.
        k_pos_of: callable ``owner -> [s_local]`` global positions of that owner's keys.
        softmax_scale, causal: as the ring's.
        fallback: kernel used for steps FA4 cannot express exactly.
        deterministic: deterministic dQ accumulation in the backward.
    """

    def __init__(self, q_pos, k_pos_of, softmax_scale: float, causal: bool, fallback, deterministic: bool = False):
        self.q_pos, self.k_pos_of = q_pos, k_pos_of
        self.softmax_scale, self.causal = softmax_scale, causal
        self.fallback, self.deterministic = fallback, deterministic
        self._plans: dict = {}
        self._out: Optional[torch.Tensor] = None
        self.fallback_steps = 0

    def begin_backward(self, out: torch.Tensor) -> None:
        """The ring's final output (``[b, sq, hq, d]``, q's dtype), for the steps' backward."""
        self._out = out

    def plan(self, owner: int) -> StepPlan:
        if owner not in self._plans:
            self._plans[owner] = plan_step(self.q_pos, self.k_pos_of(owner), self.causal)
        return self._plans[owner]

    def forward(self, q, k, v, owner: int):
        p = self.plan(owner)
        if p.kind == "none":
            return None
        if p.kind == "unsupported":
            self.fallback_steps += 1
            return self.fallback.forward(q, k, v, owner)
        out, lse = fa4_forward(q, k, v, softmax_scale=self.softmax_scale, causal=p.kind == "causal",
                               sparsity=p.sparsity)
        return out.float(), lse

    def backward(self, dout, q, k, v, lse, delta, owner: int, out=None):
        p = self.plan(owner)
        if p.kind == "none":
            return None
        out = self._out if out is None else out
        # FA4 has no deterministic block-sparse backward (SM90): those steps take the fallback's
        # deterministic backward (any exact kernel: the step's gradients depend only on lse/delta)
        if p.kind == "unsupported" or out is None or (self.deterministic and p.sparsity is not None):
            return self.fallback.backward(dout, q, k, v, lse, delta, owner)
        dq, dk, dv = fa4_backward(dout, q, k, v, out, lse, softmax_scale=self.softmax_scale,
                                  causal=p.kind == "causal", sparsity=p.sparsity, deterministic=self.deterministic)
        return dq.float(), dk.float(), dv.float()


def make_fa4_dense_step(layout, rank: int, seq_len: int, softmax_scale: float, causal: bool = True, device=None,
                        *, fallback, deterministic: bool = True) -> FA4DenseStepKernel:
    """The dense ring step kernel of the ``"fa4"`` backend (``dense_step`` of
    :class:`~megatron_mtraining.ops.backends.KernelBackend`): ``fallback(layout, rank, seq_len,
    softmax_scale, causal, device=device)`` builds the kernel for the steps FA4 cannot express."""
    fb = fallback(layout, rank, seq_len, softmax_scale, causal, device=device)
    q_pos = layout.positions(rank, seq_len, device=device)
    k_pos = {}

    def k_pos_of(owner: int) -> torch.Tensor:
        if owner not in k_pos:
            k_pos[owner] = layout.positions(owner, seq_len, device=device)
        return k_pos[owner]

    return FA4DenseStepKernel(q_pos, k_pos_of, softmax_scale, causal, fb, deterministic=deterministic)


def _without_blocks(idx):
    """``idx`` with its block (slash) work removed: the vertical columns only. Its ``known_max`` records no
    block (``block == 0``), so the Triton plan of these columns builds no block structures
    (:attr:`~megatron_mtraining.ops.triton.launch.SparsePlan.no_blocks`): ``idx``'s record with the block
    bound 0 where it is valid, else the column lists' width as the column bound (``exact=False``; the
    counts never exceed it)."""
    from ..patterns.indices import KnownMax, StepIndices

    b, hq, nqb = idx.block_count.shape
    bc = torch.zeros_like(idx.block_count)
    k = idx.known_max
    if k is not None and k.valid_for(idx.block_count, idx.column_count):
        known = KnownMax.of(bc, idx.column_count, 0, k.column, k.exact, k.union)
    else:
        known = KnownMax.of(bc, idx.column_count, 0, idx.column_index.shape[-1], exact=False)
    return StepIndices(bc, torch.full((b, hq, nqb, 1), -1, dtype=idx.block_index.dtype, device=bc.device),
                       idx.column_count, idx.column_index, idx.causal, idx.block_size, known_max=known,
                       column_union=idx.column_union)     # the same column lists: a valid record stays valid


def _has(idx, which: str) -> bool:
    """Whether ``idx`` lists any block / column, from ``known_max`` when valid (else assume yes)."""
    k = idx.known_max
    if k is not None and k.valid_for(idx.block_count, idx.column_count):
        return getattr(k, which) > 0
    return True


#: Raised inside a CUDA-graph capture by the FA4 sparse steps while :attr:`FA4SparseStepKernel.capture` is ``False``
#: (the layer then runs eagerly, :class:`~megatron_mtraining.ring.graphs.CUDAGraphedAttention` warns once).
FA4_CAPTURE_RULE = ("FlashAttention-4's sparse steps (vertical_slash.block_size 128) are set not to be captured in CUDA "
                    "graphs (FA4SparseStepKernel.capture is False): with cuda_graphs: true such a layer runs eagerly, "
                    "and other captures around the attention (Megatron's CUDA graphs, torch.compile's reduce-overhead "
                    "mode) are refused; set FA4SparseStepKernel.capture = True to capture them")


def _capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s CUDA stream is being captured into a CUDA graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class FA4SparseStepKernel(SparseStepKernel):
    """Vertical-slash ring step kernel: slash blocks on FA4, vertical columns on the Triton kernels.

    The ring's sparse step-kernel protocol (:class:`~megatron_mtraining.ops.sparse_reference.SparseStepKernel`):
    ``forward(q, k, v, owner) -> (out fp32, lse fp32) | None``,
    ``backward(dout, q, k, v, lse, delta, owner) -> (dq, dk, dv) fp32 | None``; a step that runs FA4 alone
    in a one-step ring without a column phase (CP=1) returns FA4's ``out`` / ``dq, dk, dv`` in q's dtype
    (``_only_step``: the ring takes them as they are, no fp32 copies). For each step the
    slash blocks (``StepIndices`` at 128-token blocks) run :func:`fa4_forward` / :func:`fa4_backward`
    with per-head block lists (:func:`sparsity_from_indices`; FA4's causal mask on the rank's own
    step) and the step's token-level columns run ``fallback`` (the Triton sparse kernel); the two are
    merged by LSE (:func:`~megatron_mtraining.ops.merge.merge_attention_fast`: one fused Triton launch on
    CUDA, :func:`~megatron_mtraining.ops.merge.merge_attention` elsewhere), and their gradients,
    which both derive from the ring's final ``lse``/``out``, are summed. Out-of-ring column work
    (:class:`~megatron_mtraining.ring.sparse.ColumnPhase`) runs ``fallback`` entirely.

    The backward needs the ring's final ``out`` (:meth:`begin_backward`). With
    ``deterministic=True`` (FA4 has no deterministic block-sparse backward on SM90) the backward of
    every step runs ``fallback``, which is exact for any step.

    Args:
        steps: per-owner :class:`~megatron_mtraining.patterns.indices.StepIndices`, ``block_size`` 128.
        softmax_scale: attention scale.
        fallback: a sparse step kernel over the same ``steps`` (its ``forward_fn``/``backward_fn``
            run the columns and the deterministic backward).
        deterministic: backward without floating-point atomics.

    Raises:
        ValueError: a step whose ``block_size`` is not 128.
        RuntimeError: a forward inside a CUDA-graph capture while :attr:`capture` is ``False``
            (:data:`FA4_CAPTURE_RULE`; ``cuda_graphs: true`` then runs the layer eagerly).
    """

    #: Whether a CUDA-graph capture may record these steps (``False``: a capture raises
    #: :data:`FA4_CAPTURE_RULE`, and ``cuda_graphs: true`` runs such layers eagerly).
    capture = True

    def __init__(self, steps, softmax_scale: float, *, fallback, deterministic: bool = False):
        self.fallback, self.deterministic = fallback, bool(deterministic)
        super().__init__(steps, softmax_scale)
        bad = sorted({s.block_size for s in self.steps} - {FA4_BLOCK})
        if bad:
            raise ValueError(f"FA4 sparse steps need {FA4_BLOCK}-token blocks, got block_size {bad[0]}")
        self._ring_ids = {id(s) for s in self.steps}
        self._cache: dict = {}           # id(indices) -> (indices, BlockSparsity, columns-only indices)
        self._out: Optional[torch.Tensor] = None

    @property
    def expect_backward(self) -> bool:
        return self.fallback.expect_backward

    @expect_backward.setter
    def expect_backward(self, value: bool) -> None:
        self.fallback.expect_backward = bool(value)

    @property
    def _only_step(self) -> bool:
        """The ring has one step (CP=1: one entry in ``steps``) and no column phase: a step's result is the
        ring's, which takes it as it is (:func:`~megatron_mtraining.ring.merge_partial` with ``keep``,
        :func:`~megatron_mtraining.ring.ring_pass_backward`), so FA4's outputs and gradients are returned in
        q's dtype instead of fp32 copies. With a column phase its partial and its dK/dV are added to the
        step's in fp32, as before."""
        return len(self.steps) == 1 and self.column_phase is None

    def begin_backward(self, out: torch.Tensor) -> None:
        """The ring's final output (``[b, sq, hq, d]``, q's dtype), for the FA4 backward."""
        self._out = out

    def end_backward(self) -> None:
        """Drop the output held since :meth:`begin_backward` (its autograd node refers back to this kernel).

        The steps' forward block lists stay with the kernel, which is released with the ring's autograd
        node: the backward reads them, and under CUDA graphs (:mod:`~megatron_mtraining.ring.graphs`) each
        forward replay rewrites them where the capture allocated them, so they must stay allocated until the
        layer's graphs are dropped. Freed here, the shared pool would hand their memory to the next layer's
        capture, and every backward replay would read that layer's lists instead of its own."""
        self._out = None

    def _parts(self, idx):
        """The step's forward block lists (``None``: no block) and its columns-only indices (``None``: no
        column), built once per step. The backward lists are built by the backward itself, so that a
        layer's forward keeps only the forward lists until its backward."""
        hit = self._cache.get(id(idx))
        if hit is None or hit[0] is not idx:
            sp = sparsity_from_indices(idx, backward=False) if _has(idx, "block") else None
            cols = _without_blocks(idx) if _has(idx, "column") else None
            hit = self._cache[id(idx)] = (idx, sp, cols)
        return hit[1], hit[2]

    def _forward_step(self, q, k, v, idx, scale: float):
        if id(idx) not in self._ring_ids:                       # out-of-ring columns
            return self.fallback.forward_fn(q, k, v, idx, scale)
        if not self.capture and _capturing(q):
            raise RuntimeError(FA4_CAPTURE_RULE)
        sp, cols = self._parts(idx)
        res = None
        if sp is not None:
            res = fa4_forward(q, k, v, softmax_scale=scale, causal=bool(idx.causal), sparsity=sp)
        if cols is not None:
            o2, l2 = self.fallback.forward_fn(q, k, v, cols, scale)
            # the merge reads FA4's half-precision output as it is (promoted to fp32 in the products; on CUDA
            # one fused Triton launch, elsewhere torch)
            res = (o2, l2) if res is None else merge_attention_fast(res[0], res[1], o2, l2)
        if res is None:
            return self.fallback.forward_fn(q, k, v, idx, scale)
        # FA4's half-precision output alone: in fp32 for the ring's merge, or as it is for a one-step ring
        return (res[0] if self._only_step else res[0].to(acc_dtype(res[0].dtype))), res[1]

    def _backward_step(self, dout, q, k, v, lse, delta, idx, scale: float):
        if id(idx) not in self._ring_ids or self.deterministic or self._out is None:
            return self.fallback.backward_fn(dout, q, k, v, lse, delta, idx, scale)
        sp, cols = self._parts(idx)
        grads = None
        if sp is not None:
            sp = with_backward_lists(sp)         # the backward lists from the cached forward ones
            grads = fa4_backward(dout, q, k, v, self._out, lse, softmax_scale=scale, causal=bool(idx.causal),
                                 sparsity=sp)
            del sp
        if cols is not None:
            g2 = self.fallback.backward_fn(dout, q, k, v, lse, delta, cols, scale)
            # FA4's half-precision gradients added into the columns' fp32 ones (tensors of the call's own)
            grads = g2 if grads is None else tuple(b.add_(a) for a, b in zip(grads, g2))
        if grads is None:
            return self.fallback.backward_fn(dout, q, k, v, lse, delta, idx, scale)
        return grads if self._only_step else tuple(g.to(acc_dtype(g.dtype)) for g in grads)

    forward_fn = _forward_step
    backward_fn = _backward_step


def make_fa4_sparse_step(steps, softmax_scale: float, *, fallback, deterministic: bool = False):
    """The sparse ring step kernel of the ``"fa4"`` backend (``sparse_step`` of
    :class:`~megatron_mtraining.ops.backends.KernelBackend`): :class:`FA4SparseStepKernel` for
    patterns at 128-token blocks, else ``fallback(steps, softmax_scale)`` alone (FA4's SM90 backward
    has no narrower key blocks).

    Raises:
        NotImplementedError: indices with packed-document bounds (``StepIndices.has_documents``):
            FA4's block-sparse kernels have no document mask (the torch and Triton sparse step
            kernels have one).
    """
    if any(s.has_documents for s in steps):
        raise NotImplementedError("the FA4 sparse step kernels have no document mask: packed documents with the "
                                  "vertical-slash pattern run on the Triton or torch sparse step kernels "
                                  "(kernel_backend 'auto', 'triton' or 'torch')")
    fb = fallback(steps, softmax_scale)
    if any(s.block_size != FA4_BLOCK for s in steps):
        return fb
    return FA4SparseStepKernel(steps, softmax_scale, fallback=fb, deterministic=deterministic)


# ---------------------------------------------------------------------------------------------- varlen (packed)


@dataclass(frozen=True)
class VarlenLayout:
    """How ``batch_size`` packed streams of ``seq_len`` tokens map onto one FA4 varlen (THD) batch.

    Pure host data, from the documents' offsets alone (:func:`varlen_layout`).

    Attributes:
        batch_size, seq_len: the streams (``b``, ``S``); the flat stream is ``[b * S]`` (row ``r`` at
            ``[r * S, (r + 1) * S)``).
        cu_seqlens: ``[n + 1]`` offsets of the documents in the THD batch (real tokens only; documents
            without tokens left out), ``cu_seqlens[0] == 0``.
        starts: ``[n]`` flat position (in ``b * S``) of each document's first token.
        max_seqlen: the longest document (0 when there is none).
    """

    batch_size: int
    seq_len: int
    cu_seqlens: tuple
    starts: tuple
    max_seqlen: int

    @property
    def total(self) -> int:
        """Real tokens (rows of the THD batch)."""
        return self.cu_seqlens[-1]

    @property
    def dense(self) -> bool:
        """No padding: the THD batch is the flat stream itself (a view, no copy)."""
        return self.total == self.batch_size * self.seq_len

    @property
    def lengths(self) -> tuple:
        return tuple(b - a for a, b in zip(self.cu_seqlens, self.cu_seqlens[1:]))


def varlen_layout(cu_seqlens, cu_seqlens_padded, seq_len: int, batch_size: int = 1) -> VarlenLayout:
    """The THD batch of packed streams (pure; host integers).

    Args:
        cu_seqlens: ``[n + 1]`` offsets of the real tokens (as :class:`~megatron_mtraining.layout.PackedDocuments`:
            over the ``batch_size`` rows concatenated).
        cu_seqlens_padded: ``[n + 1]`` offsets of the documents' slots (``None``: the documents are
            contiguous); a document's real tokens come first in its slot.
        seq_len, batch_size: the streams.

    Returns:
        a :class:`VarlenLayout`: document ``i`` with ``n_i > 0`` real tokens is THD rows
        ``[cu[j], cu[j] + n_i)`` and flat tokens ``[slot_i, slot_i + n_i)``; every other token is padding.
    """
    cu = [int(x) for x in cu_seqlens]
    pad = cu if cu_seqlens_padded is None else [int(x) for x in cu_seqlens_padded]
    if len(pad) != len(cu):
        raise ValueError(f"cu_seqlens_padded has {len(pad)} entries but cu_seqlens has {len(cu)}")
    out, starts = [0], []
    for i in range(len(cu) - 1):
        n = cu[i + 1] - cu[i]
        if n > 0:
            out.append(out[-1] + n)
            starts.append(pad[i])
    lengths = [b - a for a, b in zip(out, out[1:])]
    return VarlenLayout(int(batch_size), int(seq_len), tuple(out), tuple(starts), max(lengths, default=0))


def varlen_layout_of(documents) -> VarlenLayout:
    """:func:`varlen_layout` of a :class:`~megatron_mtraining.layout.PackedDocuments` (its host offsets)."""
    return varlen_layout(documents.cu_seqlens, documents.cu_seqlens_padded, documents.seq_len, documents.batch_size)


def varlen_token_index(layout: VarlenLayout, device=None) -> torch.Tensor:
    """``[total]`` int64: the flat position (in ``b * S``) of every THD row, ascending.

    Built on ``device`` from the per-document shifts without a host read (``repeat_interleave``
    with its output size known)."""
    shift = torch.tensor([s - c for s, c in zip(layout.starts, layout.cu_seqlens)], dtype=torch.int64)
    lengths = torch.tensor(layout.lengths, dtype=torch.int64)
    shift, lengths = _to_device(shift, device), _to_device(lengths, device)
    dev = shift.device
    if layout.total == 0:
        return torch.zeros(0, dtype=torch.int64, device=dev)
    return torch.repeat_interleave(shift, lengths, output_size=layout.total) + torch.arange(layout.total, device=dev)


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on ``device``: through pinned memory without a stream synchronisation on CUDA."""
    device = torch.device(device) if device is not None else t.device
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def flatten_thd(x: torch.Tensor, layout: VarlenLayout, index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [b, S, h, d]`` -> ``[total, h, d]``: the real tokens in THD order (differentiable).

    ``index``: :func:`varlen_token_index` (needed only when the layout has padding)."""
    b, s = layout.batch_size, layout.seq_len
    if tuple(x.shape[:2]) != (b, s):
        raise ValueError(f"expected [{b}, {s}, ...] for {b} packed streams of {s} tokens, got {tuple(x.shape)}")
    flat = x.reshape(b * s, *x.shape[2:])
    if layout.dense:
        return flat
    if index is None:
        index = varlen_token_index(layout, x.device)
    return flat.index_select(0, index)


def unflatten_thd(y: torch.Tensor, layout: VarlenLayout, index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y [total, h, d]`` -> ``[b, S, h, d]`` with exact zeros at padding tokens (differentiable: the
    gradient of ``y`` is the incoming gradient at the real tokens)."""
    b, s = layout.batch_size, layout.seq_len
    if layout.dense:
        return y.reshape(b, s, *y.shape[1:])
    if index is None:
        index = varlen_token_index(layout, y.device)
    full = y.new_zeros((b * s, *y.shape[1:])).index_copy(0, index, y)
    return full.view(b, s, *y.shape[1:])


def unflatten_lse(lse: torch.Tensor, layout: VarlenLayout, index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """FA4's varlen LSE ``[h, total]`` -> ``[b, h, S]``, ``-inf`` at padding tokens."""
    b, s = layout.batch_size, layout.seq_len
    h = lse.shape[0]
    if layout.dense:
        full = lse
    else:
        if index is None:
            index = varlen_token_index(layout, lse.device)
        full = lse.new_full((h, b * s), float("-inf")).index_copy(1, index, lse)
    return full.reshape(h, b, s).transpose(0, 1)


def varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, softmax_scale: float, causal: bool = True,
                     max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                     return_lse: bool = False, deterministic: bool = False, **_unused):
    """Torch stand-in for FA4's ``flash_attn_varlen_func`` (same keywords, same THD shapes): every
    sequence of ``cu_seqlens`` attended alone, causal on local indices, GQA without FA4.

    Used by the self-check (fp32 math on FA4's inputs) and by the CPU tests (fp64) of the THD glue.
    Returns ``(out [total, hq, d] in q's dtype, lse [hq, total] fp32, fp64 for fp64 inputs)``;
    differentiable by autograd. ``max_seqlen_*`` and ``deterministic`` are accepted and ignored.
    """
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if cu_q != cu_k:
        raise ValueError("varlen_reference: self-attention only (cu_seqlens_q == cu_seqlens_k)")
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    hq, hkv = q.shape[1], k.shape[1]
    rep = hq // hkv
    outs, lses = [], []
    for a, b in zip(cu_q, cu_q[1:]):
        n = b - a
        if n == 0:
            continue
        qq = q[a:b].to(acc)
        kk = k[a:b].to(acc).repeat_interleave(rep, 1)
        vv = v[a:b].to(acc).repeat_interleave(rep, 1)
        sc = torch.einsum("qhd,khd->hqk", qq, kk) * softmax_scale
        if causal:
            sc = sc.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        lses.append(torch.logsumexp(sc, -1))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(sc, -1), vv))
    if not outs:
        return q.new_zeros(q.shape), torch.zeros(hq, 0, dtype=acc, device=q.device)
    return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=1)


def _flash_attn_varlen_func() -> Callable:
    from flash_attn.cute import flash_attn_varlen_func
    return flash_attn_varlen_func


#: Device tensors of the varlen batch per documents object (every layer of a micro-batch shares them).
_VARLEN_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _varlen_tensors(documents, device: torch.device):
    """``(layout, cu_seqlens int32 [n + 1], token index or None)`` of ``documents`` on ``device``, cached."""
    per_doc = _VARLEN_CACHE.get(documents)
    if per_doc is None:
        per_doc = _VARLEN_CACHE[documents] = {}
    key = (device.type, device.index)
    hit = per_doc.get(key)
    if hit is None:
        lay = varlen_layout_of(documents)
        cu = _to_device(torch.tensor(lay.cu_seqlens, dtype=torch.int32), device)
        index = None if lay.dense else varlen_token_index(lay, device)
        hit = per_doc[key] = (lay, cu, index)
    return hit


def fa4_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents, *, softmax_scale: float,
                         deterministic: bool = False, return_lse: bool = False,
                         varlen_fn: Optional[Callable] = None):
    """Causal attention within packed documents through FA4's varlen interface, with autograd (CP=1).

    Args:
        q: ``[b, S, hq, d]``; k, v: ``[b, S, hkv, d]`` (GQA: ``hq % hkv == 0``), bf16/fp16 on a
            Hopper/Blackwell GPU for FA4.
        documents: the :class:`~megatron_mtraining.layout.PackedDocuments` of the ``b`` streams.
        softmax_scale: scale of ``q k^T``.
        deterministic: FA4's deterministic backward.
        return_lse: also return the LSE.
        varlen_fn: the varlen function (``None``: ``flash_attn.cute.flash_attn_varlen_func``; the
            tests pass :func:`varlen_reference`), called with keywords only.

    Returns:
        ``out [b, S, hq, d]`` in q's dtype (and ``lse [b, hq, S]`` fp32 with ``return_lse``). Padding
        tokens (in no document) give exact zeros in out and in every gradient, and LSE ``-inf``.
    """
    lay, cu, index = _varlen_tensors(documents, q.device)
    if tuple(q.shape[:2]) != (lay.batch_size, lay.seq_len):
        raise ValueError(f"packed documents describe {lay.batch_size} streams of {lay.seq_len} tokens but q has "
                         f"shape {tuple(q.shape)}")
    qt, kt, vt = (flatten_thd(t, lay, index) for t in (q, k, v))
    if lay.total == 0:                         # padding only: zeros, still connected to q for autograd
        out_t = qt
        lse_t = torch.zeros(q.shape[2], 0, dtype=torch.float32, device=q.device)
    else:
        fn = varlen_fn if varlen_fn is not None else _flash_attn_varlen_func()
        res = fn(qt, kt, vt, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=lay.max_seqlen,
                 max_seqlen_k=lay.max_seqlen, softmax_scale=float(softmax_scale), causal=True,
                 deterministic=bool(deterministic), return_lse=bool(return_lse))
        out_t, lse_t = (res[0], res[1]) if isinstance(res, (tuple, list)) else (res, None)
        if return_lse and (lse_t is None or tuple(lse_t.shape) != (q.shape[2], lay.total)):
            raise RuntimeError(f"flash_attn_varlen_func returned an LSE of shape "
                               f"{None if lse_t is None else tuple(lse_t.shape)}, expected "
                               f"[{q.shape[2]}, {lay.total}] (heads, total tokens)")
    out = unflatten_thd(out_t, lay, index)
    if not return_lse:
        return out
    return out, unflatten_lse(lse_t.float() if lse_t.dtype != torch.float64 else lse_t, lay, index)


def fa4_packed_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, documents, *,
                      deterministic: bool = False, varlen_fn: Optional[Callable] = None) -> torch.Tensor:
    """Packed dense attention at CP=1 through FA4 varlen (the backend's ``packed_cp1``; bshd, out in q's
    dtype; ``varlen_fn`` as for :func:`fa4_varlen_attention`)."""
    return fa4_varlen_attention(q, k, v, documents, softmax_scale=softmax_scale, deterministic=deterministic,
                                varlen_fn=varlen_fn)


# ---------------------------------------------------------------------------------------------- self-check

#: Largest relative error (out, lse, dq, dk, dv against fp32 math on the same inputs) the self-check
#: accepts. bf16 inputs give about 4e-3 (out) to 1e-2 (gradients) here; a wrong kernel gives O(1).
SELF_CHECK_TOLERANCE = 5e-2


def _compare(pairs, head_dim, hq, hkv, dtype, what: str = "") -> Optional[str]:
    for name, (a, ref) in zip(("out", "lse", "dq", "dk", "dv"), pairs):
        err = float((a.float() - ref).norm() / ref.norm().clamp_min(1e-30))
        if not err <= SELF_CHECK_TOLERANCE:
            return (f"FA4 self-check failed for head_dim {head_dim}, {hq}/{hkv} heads, {dtype}: {what}{name} "
                    f"relative error {err:.2e} > {SELF_CHECK_TOLERANCE:.0e}")
    return None


@contextlib.contextmanager
def _self_check_mode():
    """Autograd on (inference mode off) and autocast off while a self-check runs, whatever the caller's
    mode: a layer's first call can come under ``torch.no_grad`` (full activation recomputation runs the
    forward without autograd), and a check that failed there would be cached and send every later call
    to the Triton kernels."""
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast("cuda", enabled=False), \
            torch.autocast("cpu", enabled=False):
        yield


@functools.lru_cache(maxsize=None)
def _self_check_cached(device_index: int, dtype: torch.dtype, head_dim: int, hq: int, hkv: int) -> Optional[str]:
    dev = torch.device("cuda", device_index)
    g = torch.Generator(device="cpu").manual_seed(1234)
    s = 2 * FA4_BLOCK
    mk = lambda h: torch.randn(2, s, h, head_dim, generator=g).to(dev, dtype)
    q, k, v, do = mk(hq), mk(hkv), mk(hkv), mk(hq)
    scale = head_dim ** -0.5
    # a block-sparse step (block-causal, diagonal tiles visible) and a causal step
    tile = torch.arange(FA4_BLOCK, device=dev)
    stripes = lambda *starts: torch.cat([tile + x for x in starts])
    steps = [(stripes(FA4_BLOCK, 3 * FA4_BLOCK), stripes(0, 2 * FA4_BLOCK)),   # block-causal, inclusive
             (torch.arange(s, device=dev), torch.arange(s, device=dev))]         # causal
    try:
        qf, kf, vf, dof = (t.float() for t in (q, k, v, do))
        rep = hq // hkv
        kk, vv = kf.repeat_interleave(rep, 2), vf.repeat_interleave(rep, 2)
        for q_pos, k_pos in steps:
            plan = plan_step(q_pos, k_pos)
            if plan.kind not in ("blocks", "causal"):
                return f"FA4 self-check: unexpected step plan {plan.kind!r}"
            qr = qf.clone().requires_grad_()
            kr, vr = kk.clone().requires_grad_(), vv.clone().requires_grad_()
            sc = torch.einsum("bqhd,bkhd->bhqk", qr, kr) * scale
            sc = sc.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
            lse_ref = torch.logsumexp(sc, -1)
            out_ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(sc, -1), vr)
            dq_ref, dk_ref, dv_ref = torch.autograd.grad(out_ref, (qr, kr, vr), dof)
            dk_ref = dk_ref.view(2, s, hkv, rep, head_dim).sum(3)
            dv_ref = dv_ref.view(2, s, hkv, rep, head_dim).sum(3)
            out, lse = fa4_forward(q, k, v, softmax_scale=scale, causal=plan.kind == "causal", sparsity=plan.sparsity)
            dq, dk, dv = fa4_backward(do, q, k, v, out, lse, softmax_scale=scale, causal=plan.kind == "causal",
                                      sparsity=plan.sparsity)
            why = _compare(((out, out_ref), (lse, lse_ref), (dq, dq_ref), (dk, dk_ref), (dv, dv_ref)),
                           head_dim, hq, hkv, dtype)
            if why:
                return why
        # a sparse own step: per-head block lists (head h lists the off-diagonal tile iff h is odd)
        # under FA4's causal mask, as the vertical-slash ring runs it
        listed = torch.ones(hq, 2, 2, dtype=torch.bool, device=dev).tril()
        listed[0::2, 1, 0] = False
        cnt, idx = (t[None].expand(2, *t.shape) for t in packed_index_lists(listed, width=2, fill=0))
        bcnt, bidx = (t[None].expand(2, *t.shape) for t in packed_index_lists(listed.transpose(-1, -2), width=2, fill=0))
        sp = BlockSparsity(cnt.contiguous(), idx.contiguous(), bcnt.contiguous(), bidx.contiguous(), cnt == 0, -1)
        qr = qf.clone().requires_grad_()
        kr, vr = kk.clone().requires_grad_(), vv.clone().requires_grad_()
        mask = listed.repeat_interleave(FA4_BLOCK, 1).repeat_interleave(FA4_BLOCK, 2) & torch.ones(
            s, s, dtype=torch.bool, device=dev).tril()
        sc = (torch.einsum("bqhd,bkhd->bhqk", qr, kr) * scale).masked_fill(~mask, float("-inf"))
        out_ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(sc, -1), vr)
        dq_ref, dk_ref, dv_ref = torch.autograd.grad(out_ref, (qr, kr, vr), dof)
        dk_ref = dk_ref.view(2, s, hkv, rep, head_dim).sum(3)
        dv_ref = dv_ref.view(2, s, hkv, rep, head_dim).sum(3)
        out, lse = fa4_forward(q, k, v, softmax_scale=scale, causal=True, sparsity=sp)
        dq, dk, dv = fa4_backward(do, q, k, v, out, lse, softmax_scale=scale, causal=True, sparsity=sp)
        why = _compare(((out, out_ref), (lse, torch.logsumexp(sc, -1)), (dq, dq_ref), (dk, dk_ref), (dv, dv_ref)),
                       head_dim, hq, hkv, dtype, what="sparse causal step: ")
        if why:
            return why
    except Exception as exc:  # a compile or launch error of the DSL kernels
        return f"FA4 self-check raised {type(exc).__name__}: {exc}"
    return None


def fa4_self_check(device, dtype: torch.dtype, head_dim: int, hq: int, hkv: int) -> Optional[str]:
    """``None`` when FA4 computes a block-sparse, a causal and a sparse causal step correctly for this shape.

    Runs once per (device, dtype, head_dim, hq, hkv) and is cached: a block-causal step, a causal
    step and a causal step with per-head block lists at 256 tokens, batch 2, forward and backward, against fp32 torch math on the same inputs. Returns
    the reason otherwise (also when :func:`fa4_unavailable_reason` has one).
    """
    why = fa4_unavailable_reason(device, dtype, head_dim)
    if why is not None:
        return why
    with _self_check_mode():
        return _self_check_cached(cuda_index(device), dtype, int(head_dim), int(hq), int(hkv))


#: The self-check's packed streams (``cu_seqlens``, ``cu_seqlens_padded``): 2 rows of 256 tokens;
#: documents of 100, 30 (in a slot of 36) and 1 (its slot padded to the end of row 0) in row 0, and
#: 150 in row 1, then padding.
_SELF_CHECK_DOCS = ((0, 100, 130, 131, 281), (0, 100, 136, 256, 406))


@functools.lru_cache(maxsize=None)
def _varlen_self_check_cached(device_index: int, dtype: torch.dtype, head_dim: int, hq: int, hkv: int,
                              deterministic: bool) -> Optional[str]:
    from ..layout.documents import PackedDocuments

    dev = torch.device("cuda", device_index)
    g = torch.Generator(device="cpu").manual_seed(4321)
    b, s = 2, 2 * FA4_BLOCK
    mk = lambda h: torch.randn(b, s, h, head_dim, generator=g).to(dev, dtype)  # noqa: E731
    q, k, v, do = mk(hq), mk(hkv), mk(hkv), mk(hq)
    scale = head_dim ** -0.5
    cu, pad = _SELF_CHECK_DOCS
    docs = PackedDocuments.from_cu_seqlens(torch.tensor(cu), s, batch_size=b, cu_seqlens_padded=torch.tensor(pad),
                                           device=dev)
    try:
        def run(fn, inputs):
            xs = [t.clone().requires_grad_(True) for t in inputs]
            out, lse = fa4_varlen_attention(*xs, docs, softmax_scale=scale, deterministic=deterministic,
                                            return_lse=True, varlen_fn=fn)
            dq, dk, dv = torch.autograd.grad(out, xs, do.to(out.dtype))
            return out, lse, dq, dk, dv

        got = run(None, (q, k, v))
        ref = run(varlen_reference, tuple(t.float() for t in (q, k, v)))
        padding = ~docs.real()
        for name, t in zip(("out", "dq", "dk", "dv"), (got[0], *got[2:])):
            if not bool((t[padding] == 0).all()):
                return f"FA4 varlen self-check failed for head_dim {head_dim}, {hq}/{hkv} heads, {dtype}: {name} " \
                       "is not zero at padding tokens"
        real = docs.real()
        lse_got, lse_ref = got[1].transpose(1, 2)[real], ref[1].transpose(1, 2)[real]
        why = _compare(((got[0], ref[0]), (lse_got, lse_ref), *zip(got[2:], ref[2:])), head_dim, hq, hkv, dtype,
                       what="varlen (packed documents): ")
        if why:
            return why
    except Exception as exc:  # a compile or launch error of the DSL kernels
        return f"FA4 varlen self-check raised {type(exc).__name__}: {exc}"
    return None


def fa4_varlen_self_check(device, dtype: torch.dtype, head_dim: int, hq: int, hkv: int,
                          deterministic: bool = False) -> Optional[str]:
    """``None`` when FA4's varlen interface computes packed documents correctly for this shape.

    Runs once per (device, dtype, head_dim, hq, hkv, deterministic) and is cached: two streams of 256
    tokens with four documents (lengths 100, 30 in a padded slot, 1, 150) and trailing padding,
    forward (out, LSE) and backward through :func:`fa4_varlen_attention`, against
    :func:`varlen_reference` in fp32 on the same inputs, and exact zeros at the padding tokens.
    Returns the reason otherwise (also when :func:`fa4_unavailable_reason` has one).
    """
    why = fa4_unavailable_reason(device, dtype, head_dim)
    if why is not None:
        return why
    with _self_check_mode():
        return _varlen_self_check_cached(cuda_index(device), dtype, int(head_dim), int(hq), int(hkv),
                                         bool(deterministic))
