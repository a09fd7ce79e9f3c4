"""The measured layer policy of ``dense_layers: auto``: each layer runs sparse or dense, whichever is faster.

MTraining's sparse attention pays only where a layer's pattern skips enough work to cover the
estimation, index conversion and plans (MTraining §3.2; at short lengths a layer whose heads keep
most of the causal work is slower sparse than dense). With ``dense_layers: auto`` in the config, the
first call of each layer decides, and every later call follows the decision. A decision belongs to the
run's sequence length and CP size (the plan's ``seq_len`` and ``cp_size``, the same on every rank): a run
resumed at another ``--seq-length`` or CP size decides again, while calls of one run at other lengths
(packed THD streams, evaluation at other lengths) keep it, so that every rank makes the same collectives.

1. **Time both.** The layer's sparse attention (its own budgets, its kernels, CUDA graphs where the
   config asks for them) and the dense attention the config would run in its place are each timed on
   the first call's ``q, k, v``: forward and backward of a fixed random output gradient, ``TIMING_WARMUP``
   untimed calls then the median of ``TIMING_REPEATS``
   (:func:`~megatron_mtraining.bench.speed.time_forward_backward`; CUDA events on a GPU, the wall clock
   on the CPU). Autograd is on for the timing even when the call itself runs without gradients
   (activation recomputation's first forward) or under ``torch.inference_mode``. The timing calls work
   on detached copies: the call's tensors, the autograd graph, the global RNG streams and the kept-work
   statistics (:meth:`~megatron_mtraining.plan.CPPlan.track_kept_fraction`) are untouched.
2. **Agree.** The two times are summed over the process groups given (every rank that holds the layer:
   data-parallel × context-parallel, then tensor-parallel); the layer runs dense where the summed dense
   time is below the summed sparse time, and a MAX all-reduce of that verdict makes it one decision on
   every rank. The CP ranks time together (each timing call is one ring), so warm-up and repeat counts
   are fixed, never budgeted by the clock.
3. **Keep.** The decision is stored in the run plan (:meth:`~megatron_mtraining.plan.CPPlan.layer_decisions`),
   which the example trainer saves in its checkpoints and restores on ``--load``: a resumed run (same
   sequence length and CP size) takes the saved decisions instead of timing again, so it continues exactly.

The cost is one-time: ``2 × (TIMING_WARMUP + TIMING_REPEATS)`` forward and backward calls of the layer's
attention at its first call.

This module does not import megatron.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from megatron_mtraining.distributed import collective_device

__all__ = ["LayerDecision", "AutoLayerRunner", "TIMING_WARMUP", "TIMING_REPEATS", "layer_decision_lines"]

#: untimed forward and backward calls of each attention before the samples (Triton compilation, plan caches)
TIMING_WARMUP = 2
#: timed forward and backward calls of each attention (the median counts)
TIMING_REPEATS = 5


@dataclass(frozen=True)
class LayerDecision:
    """One layer's measured choice at one sequence length.

    Attributes:
        layer_number: 1-based global layer number.
        seq_len: the run's global sequence length in tokens (the plan's ``seq_len``; ``None`` for a plan
            resolved without one), which the decision belongs to.
        cp_size: the run's CP size, which the decision belongs to.
        dense: ``True``: the layer runs the dense attention; ``False``: sparse.
        sparse_ms, dense_ms: forward and backward time of one call in milliseconds, summed over the
            agreeing ranks (``nan`` for a decision restored without its times).
        ranks: the number of ranks whose times were summed.
        tokens: the global length of the call that was timed.
    """

    layer_number: int
    seq_len: Optional[int]
    cp_size: int
    dense: bool
    sparse_ms: float
    dense_ms: float
    ranks: int
    tokens: int

    @property
    def key(self) -> tuple:
        """``(layer_number, seq_len, cp_size)``: what the decision is stored under."""
        return (self.layer_number, self.seq_len, self.cp_size)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LayerDecision":
        """The inverse of :meth:`to_dict` (a checkpoint's record).

        Raises:
            ValueError: a record without ``layer_number``, ``seq_len`` and ``dense``.
        """
        try:
            seq_len = d["seq_len"]
            return cls(layer_number=int(d["layer_number"]), seq_len=None if seq_len is None else int(seq_len),
                       cp_size=int(d["cp_size"]), dense=bool(d["dense"]),
                       sparse_ms=float(d.get("sparse_ms", math.nan)), dense_ms=float(d.get("dense_ms", math.nan)),
                       ranks=int(d.get("ranks", 0)), tokens=int(d.get("tokens", seq_len or 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"layer policy record {d!r}: needs layer_number, seq_len, cp_size and dense "
                             f"({type(e).__name__}: {e})") from None


def _ranges(numbers: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3,7"``; ``"none"`` for no layer."""
    out, run = [], []
    for n in sorted(numbers) + [None]:
        if n is not None and run and n == run[-1] + 1:
            run.append(n)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [n] if n is not None else []
    return ",".join(out) or "none"


def layer_decision_lines(decisions: Sequence[LayerDecision]) -> list[str]:
    """Log lines for ``decisions``, one per (sequence length, CP size), e.g.
    ``"dense_layers: auto at 32768 tokens, CP=1: dense 1-3,7; sparse 4-6 | fwd+bwd ms sparse/dense: 1: 15.3/7.7, ..."``
    (times summed over the agreeing ranks)."""
    lines = []
    for seq_len, cp in sorted({(d.seq_len, d.cp_size) for d in decisions}, key=lambda t: (t[0] or 0, t[1])):
        ds = sorted((d for d in decisions if (d.seq_len, d.cp_size) == (seq_len, cp)), key=lambda d: d.layer_number)
        dense = [d.layer_number for d in ds if d.dense]
        sparse = [d.layer_number for d in ds if not d.dense]
        times = ", ".join(f"{d.layer_number}: {d.sparse_ms:.2f}/{d.dense_ms:.2f}" for d in ds)
        tokens = seq_len if seq_len is not None else ds[0].tokens
        lines.append(f"dense_layers: auto at {tokens} tokens, CP={cp}: dense {_ranges(dense)}; "
                     f"sparse {_ranges(sparse)} | fwd+bwd ms sparse/dense: {times}")
    return lines


def _covers(group, sub) -> bool:
    """Whether every rank of ``sub`` is in ``group``."""
    ranks = torch.distributed.get_process_group_ranks
    return set(ranks(sub)) <= set(ranks(group))


def _agree(sparse_ms: float, dense_ms: float, groups: Sequence[Any]) -> tuple[bool, float, float, int]:
    """Sum the times over ``groups`` in turn, decide, and make the verdict one value on every rank."""
    groups = [g for g in groups if g is not None and torch.distributed.get_world_size(g) > 1]
    times = torch.tensor([sparse_ms, dense_ms, 1.0], dtype=torch.float64)
    for g in groups:
        t = times.to(collective_device(g))
        torch.distributed.all_reduce(t, group=g)
        times = t.cpu()
    sparse_sum, dense_sum, ranks = times.tolist()
    verdict = torch.tensor([1.0 if dense_sum < sparse_sum else 0.0], dtype=torch.float64)
    for g in groups:               # equal sums give equal verdicts; MAX makes sure of it
        t = verdict.to(collective_device(g))
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=g)
        verdict = t.cpu()
    return bool(verdict.item() > 0), sparse_sum, dense_sum, int(round(ranks))


class AutoLayerRunner:
    """One layer's attention under ``dense_layers: auto``: ``run(q, k, v, *, softmax_scale, documents=None)``.

    Built by :meth:`~megatron_mtraining.plan.CPPlan.attention_runner` for a sparse layer of a config with
    ``dense_layers: auto``. The layer's first call decides as the module docstring describes (unless the run
    plan already holds a decision for this layer at the run's sequence length and CP size, e.g. restored
    from a checkpoint); every call then runs the chosen attention.

    Args:
        sparse_plan: the layer's sparse view of the run plan (:meth:`~megatron_mtraining.plan.CPPlan.for_layer`).
        dense_plan: the same layer's dense view.
        groups: the process groups whose ranks hold this layer, summed in turn (e.g. Megatron's
            data-parallel group with CP, then the tensor-parallel group). The CP group goes first unless a
            given group holds all its ranks: every CP rank must reach the same decision, or the ring would
            hang. Ranks outside these groups decide on their own (give every group that holds the layer).
        timer: ``timer(attention, q, k, v) -> milliseconds`` (default: the median of
            :func:`~megatron_mtraining.bench.speed.time_forward_backward`); tests pass fake ones.

    Every rank of the groups must make the layer's first call together (as the first training step does).
    """

    def __init__(self, sparse_plan, dense_plan, groups: Sequence[Any] = (),
                 timer: Optional[Callable[..., float]] = None):
        self.sparse_plan = sparse_plan
        self.dense_plan = dense_plan
        groups = tuple(g for g in groups if g is not None)
        cp = sparse_plan.cp_group
        if cp is not None and not any(_covers(g, cp) for g in groups):
            groups = (cp,) + groups            # the CP ranks must agree whatever else is given
        self.groups = groups
        self.timer = timer or _time_fwd_bwd
        self._sparse = sparse_plan.fixed_attention_runner()      # cuda_graphs: this layer's own graphs
        self._dense = dense_plan.attention

    def decision(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float,
                 documents=None) -> LayerDecision:
        """This layer's decision: the stored one, else measured on this call's inputs and stored now."""
        found = self.sparse_plan.layer_decision()
        if found is not None:
            return found
        kw = dict(softmax_scale=softmax_scale, documents=documents)
        with self.sparse_plan.kept_fraction_paused(), torch.inference_mode(False), torch.enable_grad():
            sparse_ms = float(self.timer(lambda a, b, c: self._sparse(a, b, c, **kw), q, k, v))
            dense_ms = float(self.timer(lambda a, b, c: self._dense(a, b, c, **kw), q, k, v))
        dense, sparse_sum, dense_sum, ranks = _agree(sparse_ms, dense_ms, self.groups)
        plan = self.sparse_plan
        decided = LayerDecision(layer_number=int(plan.layer_number), seq_len=plan.seq_len, cp_size=int(plan.cp_size),
                                dense=dense, sparse_ms=sparse_sum, dense_ms=dense_sum, ranks=ranks,
                                tokens=int(q.shape[1]) * int(plan.cp_size))
        plan.record_layer_decision(decided)
        return decided

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float,
                 documents=None) -> torch.Tensor:
        d = self.decision(q, k, v, softmax_scale=softmax_scale, documents=documents)
        run = self._dense if d.dense else self._sparse
        return run(q, k, v, softmax_scale=softmax_scale, documents=documents)


def _time_fwd_bwd(attention, q, k, v) -> float:
    from megatron_mtraining.bench.speed import time_forward_backward

    timing = time_forward_backward(attention, q, k, v, device=q.device, warmup=TIMING_WARMUP, repeats=TIMING_REPEATS)
    return timing.median_ms
