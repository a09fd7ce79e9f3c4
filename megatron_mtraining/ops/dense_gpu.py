"""Dense ring step on the GPU: the Triton block kernel with position masks.

Every step of the dense ring is attention of the local queries over one owner's keys under the
causal structure of *global* positions (key visible iff ``k_pos <= q_pos``). For striped layouts
with 64-token chunks this structure is block-causal (inclusive for ``owner < rank``, strict for
``owner > rank``), for zigzag it is two causal/full/empty halves, for ``granularity < 64`` it is
token-level inside every tile. cuDNN/flash SDPA only know the standard causal and full masks, so
the step uses the sparse kernels of :mod:`megatron_mtraining.ops.triton` with a *dense* plan:
each 64-row query tile lists every 64-key block that some of its queries can see; blocks wholly in
the past run unmasked, blocks that straddle the boundary are masked by positions (mask mode 2),
blocks wholly in the future are skipped. The backward uses the global ``lse``/``delta`` exactly
like the torch reference (no atomics: bitwise deterministic).

Public API::

    kernel = DenseGpuStepKernel(layout, rank, seq_len, softmax_scale, causal=True, device=q.device)
    # kernel.forward(q, k, v, owner) -> (out fp32, lse fp32) | None
    # kernel.backward(dout, q, k, v, lse, delta, owner) -> (dq, dk, dv) fp32 | None

Packed documents (``documents=``, :class:`~megatron_mtraining.layout.PackedDocuments`): the plan
lists, per 64-row tile, only the key blocks that meet the tile's document intervals; blocks inside
every row's interval run unmasked and the others with the bounds mask (mode 3: ``lo <= k_pos <= hi``),
so padding rows and other documents' keys cost nothing and give exact zeros. Streams of a batch with
different documents run one launch per stream.

The kernel runs where the Triton kernels do (bf16/fp16/fp32 on CUDA, or the CPU under the Triton
interpreter; ``head_dim`` in 16/32/64/128/256; a local length that is a multiple of 64).
:func:`~megatron_mtraining.ops.backends.select_backend` checks these limits before choosing it and
falls back to the torch reference (:class:`~megatron_mtraining.ops.reference.DenseStepKernel`)
otherwise.
"""

from __future__ import annotations

from typing import Optional

from .reference import DenseStepKernel

__all__ = ["DenseGpuStepKernel"]

_BLOCK = 64


class DenseGpuStepKernel(DenseStepKernel):
    """Ring step kernel (:class:`~megatron_mtraining.ops.base.StepKernel`) of the dense ring on Triton.

    Args:
        layout: the CP :class:`~megatron_mtraining.layout.Layout` (``positions(rank, seq_len)``).
        rank: this rank in the CP group.
        seq_len: global sequence length.
        softmax_scale: attention scale.
        causal: causal mask on global positions (else full attention).
        device: where the position tensors and plans live.
        deterministic: passed to the backward (the dense plan has no vertical columns, so both
            modes are deterministic).
        row_block: query rows per tile of the forward and dQ kernels: 64 (default, 4 warps) or 128
            (8 warps; measured 5-20 % slower on the H200 with Triton 3.6).
        config: launch parameters (:class:`~megatron_mtraining.ops.triton.launch.KernelConfig`; default
            its defaults).
        stats: a dict receiving the registers / spills of each launched kernel, or ``None``.
        documents: packed documents (64-row tiles; see the module docstring).
    """

    def __init__(self, layout, rank: int, seq_len: int, softmax_scale: float, causal: bool = True, device=None,
                 deterministic: bool = True, row_block: int = 64, config=None, stats: Optional[dict] = None,
                 documents=None):
        super().__init__(layout, rank, seq_len, softmax_scale, causal, device=device, documents=documents)
        self.deterministic, self.row_block = deterministic, row_block
        self.config, self.stats = config, stats
        self._plans = {}
        self._rows = None
        if self.q_lo is not None:       # one plan for all streams when their documents are the same
            same = bool((self.q_lo == self.q_lo[:1]).all() and (self.q_hi == self.q_hi[:1]).all())
            self._rows = [slice(None)] if same else [slice(i, i + 1) for i in range(self.q_lo.shape[0])]

    def _document_plan(self, owner: int, row: int):
        key = (owner, row)
        if key not in self._plans:
            from .triton import document_plan
            self._plans[key] = document_plan(self.q_lo[row], self.q_hi[row], self.k_pos(owner))
        return self._plans[key]

    def _rows_with_plans(self, owner: int):
        """``[(rows, plan), ...]`` of a packed step: the batch rows and their plan (``None``: no key)."""
        return [(r, self._document_plan(owner, 0 if r == slice(None) else r.start)) for r in self._rows]

    def _packed_forward(self, q, k, v, owner: int):
        from .triton import sparse_forward
        parts = []
        for rows, plan in self._rows_with_plans(owner):
            qr = q[rows]
            if plan is None:
                parts.append(None)
                continue
            parts.append(sparse_forward(qr, k[rows], v[rows], plan, self.softmax_scale, config=self.config,
                                        stats=self.stats))
        if len(parts) == 1:
            return parts[0]
        import torch
        b, sq, hq, d = q.shape
        out = torch.zeros((b, sq, hq, d), dtype=torch.float32, device=q.device)
        lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float32, device=q.device)
        for i, part in enumerate(parts):
            if part is not None:
                out[i:i + 1], lse[i:i + 1] = part
        return out, lse

    def _packed_backward(self, dout, q, k, v, lse, delta, owner: int):
        from .triton import sparse_backward
        import torch
        grads = []
        for rows, plan in self._rows_with_plans(owner):
            if plan is None:
                grads.append(None)
                continue
            grads.append(sparse_backward(dout[rows], q[rows], k[rows], v[rows], lse[rows], delta[rows], plan,
                                         self.softmax_scale, self.deterministic, config=self.config,
                                         stats=self.stats))
        if len(grads) == 1:
            return grads[0]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        for i, g in enumerate(grads):
            if g is not None:
                dq[i:i + 1], dk[i:i + 1], dv[i:i + 1] = g
        return dq, dk, dv

    def plan(self, owner: int):
        """The dense plan of this step (cached; ``None`` when no key is visible)."""
        if owner not in self._plans:
            from .triton import dense_plan
            rows = self.row_block if self.q_pos.numel() % self.row_block == 0 else _BLOCK
            self._plans[owner] = dense_plan(self.q_pos, self.k_pos(owner), self.causal, row_block=rows)
        return self._plans[owner]

    def forward(self, q, k, v, owner: int):
        if not self.visible(owner):
            return None
        if self._rows is not None:
            self._check_batch(q)
            return self._packed_forward(q, k, v, owner)
        plan = self.plan(owner)
        if plan is None:
            return None
        from .triton import sparse_forward
        return sparse_forward(q, k, v, plan, self.softmax_scale, config=self.config, stats=self.stats)

    def backward(self, dout, q, k, v, lse, delta, owner: int):
        if not self.visible(owner):
            return None
        if self._rows is not None:
            return self._packed_backward(dout, q, k, v, lse, delta, owner)
        plan = self.plan(owner)
        if plan is None:
            return None
        from .triton import sparse_backward
        return sparse_backward(dout, q, k, v, lse, delta, plan, self.softmax_scale, self.deterministic,
                               config=self.config, stats=self.stats)
