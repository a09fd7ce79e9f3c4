"""Process-group helpers and the ring communicator.

Process groups are always passed explicitly (a Megatron CP group, or any sub-group of a larger
world); ``group=None`` means "no context parallelism" (one rank, no communication). Peers are
group-local ring neighbours translated to global ranks, so CP sub-groups of a TP×CP×DP world
work unchanged.

Failures. Every wait of the ring's transfers and every collective of the ring, the estimator and the
input check goes through :func:`comm_context` / :func:`wait_all`: it completes, or fails within the
process group's own timeout and raises :class:`CommError`, whose message names the operation (which
ring, forward or backward, the step), this rank and the peer ranks. The timeout is the group's:
``torch.distributed.init_process_group(timeout=...)`` for the default group,
``torch.distributed.new_group(ranks, timeout=...)`` for groups built from it (without ``timeout``,
torch gives a new group its backend default, 30 minutes on gloo and 10 on NCCL, not the default
group's), ``megatron.core.parallel_state.initialize_model_parallel(distributed_timeout_minutes=...)``
for Megatron's groups (Megatron-LM's and the example trainer's ``--distributed-timeout-minutes``).

On gloo a peer process that died is seen at once (``Connection closed by peer`` / ``Connection reset
by peer``), a peer that is alive but does not take part (stuck, or raised and kept running) at the
timeout (``Timed out waiting ...ms``). On NCCL, waits do not block the host: a transfer that never
completes is found by NCCL's watchdog, which aborts the process at the timeout with its own message
(operation and sequence number, not the ring step); with ``TORCH_NCCL_BLOCKING_WAIT=1`` the wait
blocks and raises, and the error names the ring step as on gloo (PyTorch's documented NCCL
behaviour; the fault tests, ``tests/distributed/test_ring_faults.py``, run on gloo).
"""

from __future__ import annotations

import datetime
import hashlib
import struct
from contextlib import contextmanager
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["group_size", "group_rank", "collective_device", "RingComm", "CommError", "comm_context", "wait_all", "group_timeout",
           "agree_across_ranks", "check_consistent_across_ranks",
           "hierarchical_numbering_error", "check_hierarchical_consistent"]

ProcessGroup = Optional[dist.ProcessGroup]


def group_size(group: ProcessGroup) -> int:
    if group is None:
        return 1
    return dist.get_world_size(group)


def collective_device(group: ProcessGroup) -> torch.device:
    """Where a small tensor for a collective over ``group`` lives: the current CUDA device for NCCL,
    the CPU otherwise (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_rank(group: ProcessGroup) -> int:
    if group is None:
        return 0
    return dist.get_rank(group)


class CommError(RuntimeError):
    """A transfer or collective of a process group failed or timed out.

    Raised by :func:`comm_context` / :func:`wait_all` (and so by every ring exchange): a peer rank
    died, raised an error, or did not take part within the process group's timeout. The message
    names the operation (``where``: which ring, forward or backward, the step), this rank (group and
    global rank), the peers and the timeout; ``__cause__`` is the backend's own error.

    Attributes:
        where: the operation, e.g. ``"flat ring forward step 0 (K/V exchange for step 1)"``.
        rank: this process's global rank.
        peers: the global ranks it was exchanging with (sends to and receives from, or the group).
        timeout: the process group's timeout (``None`` when it cannot be read).
    """

    def __init__(self, message: str, *, where: str = "", rank: int = -1, peers: tuple = (),
                 timeout: Optional[datetime.timedelta] = None):
        super().__init__(message)
        self.where, self.rank, self.peers, self.timeout = where, rank, tuple(peers), timeout


def group_timeout(group: ProcessGroup) -> Optional[datetime.timedelta]:
    """The timeout of ``group`` (``None``: the default group) as its backend holds it, or ``None``
    when the backend does not expose it."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        for dev in ("cuda", "cpu"):
            if torch.device(dev) in pg._device_types:
                return pg._get_backend(torch.device(dev)).options._timeout
    except Exception:            # private torch API: a missing attribute only loses the detail
        return None
    return None


def _describe_failure(where: str, group: ProcessGroup, peers: str, error: BaseException) -> str:
    me = dist.get_rank() if dist.is_initialized() else 0
    mine = dist.get_rank(group) if group is not None else me
    timeout = group_timeout(group)
    cause = (str(error).strip().splitlines() or [type(error).__name__])[0][:400]
    limit = f"the process-group timeout ({timeout})" if timeout is not None else "the process-group timeout"
    return (f"{where} failed on group rank {mine} (global rank {me}), {peers}: {cause}\n"
            f"A peer rank died, raised an error, or did not take part within {limit}; the first rank to "
            "fail has the root cause in its own log. The timeout is the process group's: "
            "torch.distributed.init_process_group(timeout=...) / new_group(ranks, timeout=...), or "
            "--distributed-timeout-minutes (Megatron-LM and the example trainer).")


@contextmanager
def comm_context(where: str, group: ProcessGroup, peers: Optional[Iterable[int]] = None,
                 peer_text: Optional[str] = None):
    """Re-raise a communication failure inside the ``with`` block as :class:`CommError` with context.

    Args:
        where: the operation, e.g. ``"vertical-slash estimator: all_reduce of the probe row max"``.
        group: the process group the operation runs on (``None``: the default group).
        peers: the global ranks involved (default: every rank of ``group``).
        peer_text: how the message names them (default: ``"with global ranks [...]"``).

    A :class:`CommError` from an inner context passes through unchanged; any other ``RuntimeError``
    (torch's ``DistBackendError`` and gloo's errors are ``RuntimeError`` subclasses) becomes a
    :class:`CommError` chained to it.
    """
    try:
        yield
    except CommError:
        raise
    except RuntimeError as e:
        if peers is None:
            peers = (dist.get_process_group_ranks(group) if group is not None
                     else list(range(dist.get_world_size())) if dist.is_initialized() else [])
        peers = tuple(peers)
        text = peer_text or f"with global ranks {list(peers)}"
        raise CommError(_describe_failure(where, group, text, e), where=where,
                        rank=dist.get_rank() if dist.is_initialized() else 0, peers=peers,
                        timeout=group_timeout(group)) from e


def wait_all(works, where: str, group: ProcessGroup, peers: Optional[Iterable[int]] = None,
             peer_text: Optional[str] = None) -> None:
    """``wait()`` on every work handle in ``works`` (``None`` entries skipped) under
    :func:`comm_context` (same arguments): they complete, or :class:`CommError` names ``where``."""
    with comm_context(where, group, peers, peer_text):
        for w in works:
            if w is not None:
                w.wait()


class RingComm:
    """Non-blocking exchange with the ring neighbours of a process group.

    ``exchange(send, recv, where)`` posts one batched send of every tensor in ``send`` to the next
    rank and one receive of every tensor in ``recv`` from the previous rank (group order),
    and returns a handle whose ``wait()`` completes them. Every rank posts the same sequence
    of exchanges, which keeps point-to-point messages matched on gloo and NCCL alike.

    A failure while posting or waiting raises :class:`CommError` naming ``"{name} ring {where}"``
    (``name``: ``"flat"``, ``"inner"`` or ``"outer"``), this rank and both neighbours, within the
    group's timeout (see the module docstring).
    """

    def __init__(self, group: ProcessGroup, name: str = "flat"):
        self.group = group
        self.name = name
        self.size = group_size(group)
        self.rank = group_rank(group)
        if self.size > 1:
            self.next_rank = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev_rank = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def exchange(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], where: str = "exchange") -> "_Pending":
        """Post the exchange; ``where`` names it in errors (e.g. ``"forward step 0 (K/V exchange for step 1)"``)."""
        if self.size == 1:
            raise RuntimeError("RingComm.exchange called on a group of size 1")
        ctx = (f"{self.name} ring {where}", self.group, (self.next_rank, self.prev_rank),
               f"sending to global rank {self.next_rank} and receiving from global rank {self.prev_rank}")
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next_rank, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev_rank, self.group) for t in recv]
        with comm_context(*ctx):
            works = dist.batch_isend_irecv(ops)
        return _Pending(works, send, recv, ctx)


class _Pending:
    def __init__(self, works, send, recv, ctx):
        self._works, self._keep = works, (send, recv)   # keep buffers alive until completion
        self.recv = recv
        self._ctx = ctx

    def wait(self):
        wait_all(self._works, *self._ctx)
        self._works = []
        return self.recv


_DTYPE_CODES = {torch.float64: 1, torch.float32: 2, torch.bfloat16: 3, torch.float16: 4}
_MSG_BYTES = 512          # local error text carried by the agreement vector (utf-8, truncated)
_WIDTH = 9                # int64 slots per field


def agree_across_ranks(group: ProcessGroup, what: str, error: Optional[str] = None, **fields) -> Optional[str]:
    """Every rank's local verdict and parameters, compared on every rank; the common verdict.

    One small ``all_gather`` of an int64 vector holding ``fields`` and this rank's local error text
    (``error``, ``None`` when its inputs are valid). Every rank receives the same table, so every
    rank returns the same answer: ``None`` when no rank reported an error and all ranks passed
    equal ``fields``; otherwise one message naming the failing group ranks and their errors, or the
    per-rank values of the fields that disagree. A rank whose input is invalid therefore still
    takes part in the collective, and its peers learn of the error instead of waiting for it.

    Args:
        group: the process group (``None`` or a group of one rank: ``error`` is returned as is).
        what: the operation, used as the message prefix.
        error: this rank's local validation error, or ``None``.
        fields: name -> int, bool, float, tuple of ints, str or torch.dtype; values every rank must
            agree on (floats compared bit for bit).

    Returns:
        ``None`` (all ranks valid and in agreement) or the error message (identical on every rank).
    """
    if group_size(group) == 1:
        return error
    names = sorted(fields)
    vec = []
    for n in names:
        vec.extend(_encode(fields[n]))
    msg = (error or "").encode("utf-8")[:_MSG_BYTES]
    buf = torch.zeros(_MSG_BYTES, dtype=torch.uint8)
    if msg:
        buf[:len(msg)] = torch.frombuffer(bytearray(msg), dtype=torch.uint8)
    mine = torch.cat([torch.tensor([int(error is not None), len(msg)] + vec, dtype=torch.int64),
                      buf.view(torch.int64)])
    mine = mine.to(collective_device(group))
    gathered = [torch.empty_like(mine) for _ in range(group_size(group))]
    with comm_context(f"{what}: all_gather of the input check", group):
        dist.all_gather(gathered, mine, group=group)
    gathered = [g.cpu() for g in gathered]
    failed = [(r, g) for r, g in enumerate(gathered) if int(g[0]) != 0]
    if failed:
        lines = []
        for r, g in failed:
            n = int(g[1])
            text = bytes(g[-_MSG_BYTES // 8:].view(torch.uint8)[:n].tolist()).decode("utf-8", errors="replace")
            lines.append(f"  group rank {r}: {text}")
        ranks = ", ".join(str(r) for r, _ in failed)
        if len(failed) == 1:
            return f"{what}: invalid input on group rank {ranks}: {lines[0].split(': ', 1)[1]}"
        return f"{what}: invalid input on group ranks {ranks}:\n" + "\n".join(lines)
    body = [g[2:2 + len(names) * _WIDTH] for g in gathered]
    if all(torch.equal(b, body[0]) for b in body):
        return None
    rows = []
    for r, b in enumerate(body):
        vals = b.view(len(names), _WIDTH).tolist()
        rows.append(f"  group rank {r}: " + ", ".join(f"{n}={_decode(v)}" for n, v in zip(names, vals)))
    return (f"{what}: ranks of the CP group disagree (all ranks must pass the same "
            f"shapes, dtypes, layout and parameters):\n" + "\n".join(rows))


def check_consistent_across_ranks(group: ProcessGroup, what: str, error: Optional[str] = None, **fields) -> None:
    """Fail fast, on every rank alike, when a rank's input is invalid or ranks disagree.

    :func:`agree_across_ranks` followed by ``raise ValueError(message)``: every rank raises the same
    error (naming the failing ranks, or the mismatching fields per rank), so no rank is left waiting
    in a point-to-point call that will never be matched.

    Raises:
        ValueError: ``error`` was set on some rank, or the ranks' ``fields`` differ.
    """
    msg = agree_across_ranks(group, what, error, **fields)
    if msg is not None:
        raise ValueError(msg)


def hierarchical_numbering_error(inner_group: ProcessGroup, outer_group: ProcessGroup,
                                 group: ProcessGroup = None) -> Optional[str]:
    """Local check of the two-level ring's group numbering; the error text, or ``None``.

    MTraining §4.2 (Alg. 2) runs the inner ring inside the outer ring with Megatron's hierarchical
    CP numbering (``--hierarchical-context-parallel-sizes INNER OUTER``): the inner group holds
    ``inner`` consecutive CP ranks, the outer group the CP ranks ``inner`` apart, so
    ``cp_rank = outer_rank * inner + inner_rank``. Groups built the other way round (swapped)
    compute the attention of the wrong shards.

    With ``group`` (the CP group) the inner and outer groups must be exactly the groups that this
    numbering gives for this rank (global ranks compared). Without it the CP order is the global
    rank order, and this rank's inner group must lie strictly between its outer ring neighbours;
    :func:`check_hierarchical_consistent` adds the cross-rank half of that rule (inner ranks agree
    along every outer ring, outer ranks along every inner ring).

    Process-group ranks are numbered in ascending global rank (``torch.distributed.new_group``).
    """
    n_in, n_out = group_size(inner_group), group_size(outer_group)
    if n_in < 2 or n_out < 2:
        return (f"hierarchical ring needs inner and outer rings of >= 2 ranks, got inner={n_in}, outer={n_out}; "
                "with one level of size 1 use the flat ring")
    r_in, r_out = group_rank(inner_group), group_rank(outer_group)
    inner_ranks = dist.get_process_group_ranks(inner_group)
    outer_ranks = dist.get_process_group_ranks(outer_group)
    swapped = (" (inner = consecutive CP ranks, outer = CP ranks `inner` apart: are the inner and outer "
               "groups swapped?)")
    if group is not None:
        cp = group_size(group)
        if cp != n_in * n_out:
            return f"hierarchical sizes inner*outer = {n_in}*{n_out} != CP group size {cp}"
        cp_ranks = dist.get_process_group_ranks(group)
        me = group_rank(group)
        want_in = [cp_ranks[(me // n_in) * n_in + j] for j in range(n_in)]
        want_out = [cp_ranks[o * n_in + me % n_in] for o in range(n_out)]
        if inner_ranks != want_in or outer_ranks != want_out:
            return (f"hierarchical groups do not follow the CP numbering cp_rank = outer_rank * inner + inner_rank: "
                    f"CP rank {me} has inner group {inner_ranks} and outer group {outer_ranks} (global ranks), "
                    f"expected {want_in} and {want_out}" + swapped)
        return None
    lo = outer_ranks[r_out - 1] if r_out > 0 else -1
    hi = outer_ranks[r_out + 1] if r_out + 1 < n_out else float("inf")
    if not all(lo < g < hi for g in inner_ranks) or set(inner_ranks) & set(outer_ranks) != {dist.get_rank()}:
        return (f"hierarchical groups do not follow the CP numbering cp_rank = outer_rank * inner + inner_rank: "
                f"global rank {dist.get_rank()} has inner group {inner_ranks} and outer group {outer_ranks}" + swapped)
    return None


def check_hierarchical_consistent(inner_group: ProcessGroup, outer_group: ProcessGroup, what: str,
                                  error: Optional[str] = None, **fields) -> None:
    """The agreed check of the two-level ring, without a CP group handle.

    Two gathers: over the inner group (``fields`` plus the outer rank, which must be equal along an
    inner ring), then over the outer group (``fields``, the inner rank, and the first gather's
    verdict). Every rank of the ``inner x outer`` grid thus learns every rank's verdict, and all
    raise the same error.

    Raises:
        ValueError: a rank's local ``error``, mismatching fields, or groups that do not form
            Megatron's hierarchical numbering.
    """
    first = agree_across_ranks(inner_group, f"{what} (inner ring)", error,
                               outer_rank=group_rank(outer_group), **fields)
    msg = agree_across_ranks(outer_group, f"{what} (outer ring)", first,
                             inner_rank=group_rank(inner_group), **fields)
    if msg is not None:
        raise ValueError(msg)


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
    if isinstance(value, float):
        return [5, 1, struct.unpack("<q", struct.pack("<d", value))[0]] + [0] * 6
    vals = [int(x) for x in value]
    if len(vals) > 7:                      # keep the length; compare the first 6 values and a digest of the rest
        h = struct.unpack("<q", hashlib.blake2b(struct.pack(f"<{len(vals) - 6}q", *vals[6:]), digest_size=8).digest())[0]
        return [4, len(vals)] + vals[:6] + [h]
    return [4, len(vals)] + vals + [0] * (7 - len(vals))


def _decode(slot) -> str:
    kind, n = slot[0], slot[1]
    if kind == 1:
        inv = {v: k for k, v in _DTYPE_CODES.items()}
        return str(inv.get(slot[2], "another dtype"))
    if kind == 2:
        return f"<str#{slot[2] % 100000}>"
    if kind == 3:
        return str(slot[2])
    if kind == 5:
        return repr(struct.unpack("<d", struct.pack("<q", slot[2]))[0])
    return str(tuple(slot[2:2 + min(n, 7)]))
