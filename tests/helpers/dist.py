"""Launch multi-rank CPU (gloo) runs as ``python -m torch.distributed.run`` subprocesses.

Usable by any test::

    from tests.helpers.dist import run_torchrun, run_python

    res = run_torchrun("tests/helpers/gpt_cp_worker.py", ["--cp", "2"], nproc=2, timeout=180)
    assert res.returncode == 0, res.tail()

Every run gets a free TCP port, ``OMP_NUM_THREADS=1`` (2-core CI machines: 4 ranks with default
thread pools thrash), the repository root on ``PYTHONPATH`` (so workers can
``import tests.helpers...`` and ``megatron_mtraining``), and a hard timeout.

On a CPU machine the processes are forked from :mod:`tests.helpers.forkserver` (torch and
megatron-core already imported) instead of started from scratch; ``run_torchrun`` then starts the
ranks itself with torchrun's environment and its rule that one failed rank stops the others.
``MTRAINING_TEST_FORKSERVER=0`` starts every process from scratch (and torchrun for real).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from tests.helpers.forkserver import ForkedProcess, server_for

__all__ = ["REPO_ROOT", "RunResult", "RankResult", "free_port", "worker_env", "run_torchrun", "shared_torchrun",
           "result_rows", "run_ranks", "run_python", "run_reaped", "finish_process_group", "one_rank_megatron"]

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """An unused localhost TCP port (racy by nature; :func:`run_torchrun` retries once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunResult:
    """Outcome of a subprocess run: ``returncode`` (``None`` on timeout), ``stdout``, ``stderr``, ``cmd``."""

    cmd: list[str]
    returncode: Optional[int]
    stdout: str
    stderr: str
    timed_out: bool = False

    @property
    def output(self) -> str:
        return self.stdout + "\n" + self.stderr

    def tail(self, n: int = 4000) -> str:
        """Last ``n`` characters of stdout and stderr, for assertion messages."""
        return (
            f"$ {' '.join(self.cmd)}\nrc={self.returncode} timed_out={self.timed_out}\n"
            f"--- stdout ---\n{self.stdout[-n:]}\n--- stderr ---\n{self.stderr[-n:]}"
        )


def worker_env(extra: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """Environment for worker processes (see module docstring)."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONWARNINGS"] = "ignore"
    pp = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(pp))
    if extra:
        env.update(extra)
    return env


def _run(cmd: list[str], timeout: float, env: Mapping[str, str], cwd: Path) -> RunResult:
    # own session so that a timeout kills torchrun *and* its worker processes
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(env),
        cwd=str(cwd), start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
        return RunResult(cmd, p.returncode, out, err)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = p.communicate()
        return RunResult(cmd, None, out or "", err or "", timed_out=True)


def _forked(env: Mapping[str, str]):
    return server_for(env, str(REPO_ROOT))


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _run_forked(server, script, args, timeout: float, env: Mapping[str, str], cwd: Path) -> RunResult:
    """``python script *args`` forked from the fork server; its session is killed once it exits."""
    cmd = [sys.executable, str(script), *map(str, args)]
    with tempfile.TemporaryDirectory() as tmp:
        p = ForkedProcess(server, script, args, env, cwd, os.path.join(tmp, "out"), os.path.join(tmp, "err"))
        try:
            rc: Optional[int] = p.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        p.kill_group()
        p.wait()
        return RunResult(cmd, rc, _read(os.path.join(tmp, "out")), _read(os.path.join(tmp, "err")),
                         timed_out=rc is None)


def _rank_env(env: Mapping[str, str], rank: int, nproc: int, port: int, torchrun: bool = False) -> dict[str, str]:
    """Rank ``rank`` of ``nproc`` on one node: ``env://`` variables, plus (``torchrun``) the rest of
    what torchrun gives its workers."""
    out = {**env, "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    if torchrun:
        out.update({"GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_NAME": "default",
                    "ROLE_WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "0",
                    "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none"})
    return out


def _torchrun_forked(server, script, args, nproc: int, timeout: float, env: Mapping[str, str],
                     cwd: Path) -> RunResult:
    """torchrun's job without its agent process: ``nproc`` ranks forked from the fork server; as soon
    as one rank fails the others get SIGTERM (SIGKILL 5 s later) and the result's return code is 1.
    ``stdout``/``stderr`` hold every rank's output, in rank order."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), str(script),
           *map(str, args)]
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ForkedProcess(server, script, args, _rank_env(env, r, nproc, port, torchrun=True), cwd,
                               os.path.join(tmp, f"{r}.out"), os.path.join(tmp, f"{r}.err")) for r in range(nproc)]
        deadline = time.monotonic() + timeout
        failed = None
        while time.monotonic() < deadline:
            rcs = [p.poll() for p in procs]
            failed = next((r for r, rc in enumerate(rcs) if rc not in (None, 0)), None)
            if failed is not None or all(rc == 0 for rc in rcs):
                break
            time.sleep(0.05)
        timed_out = failed is None and any(p.poll() is None for p in procs)
        if failed is not None:
            for p in procs:
                if p.poll() is None:
                    p.kill_group(signal.SIGTERM)
            stop = time.monotonic() + 5.0
            while time.monotonic() < stop and any(p.poll() is None for p in procs):
                time.sleep(0.05)
        for p in procs:
            p.kill_group()
            p.wait()
        out = "".join(_read(os.path.join(tmp, f"{r}.out")) for r in range(nproc))
        err = "".join(_read(os.path.join(tmp, f"{r}.err")) for r in range(nproc))
    if failed is not None:
        err += (f"\n[forked torchrun] rank {failed} failed with exit code {procs[failed].returncode}; "
                f"exit codes {[p.returncode for p in procs]}\n")
    rc = None if timed_out else (1 if failed is not None else 0)
    return RunResult(cmd, rc, out, err, timed_out=timed_out)


def run_torchrun(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    nproc: int = 2,
    timeout: float = 300.0,
    env: Optional[Mapping[str, str]] = None,
    module: bool = False,
    cwd: Optional[str | os.PathLike] = None,
) -> RunResult:
    """Run ``python -m torch.distributed.run --nproc-per-node nproc script *args``.

    Args:
        script: path of a script (relative paths are relative to the repository root), or a
            module name if ``module=True``.
        args: arguments for the script.
        nproc: number of ranks (1 is fine: a 1-rank torchrun world).
        timeout: seconds before the whole process tree is killed (``RunResult.timed_out``).
        env: extra environment variables.
        module: run ``script`` as ``-m module``.
        cwd: working directory (default: repository root).

    Returns:
        :class:`RunResult` (never raises on a non-zero exit; check ``returncode``).
    """
    cwd = Path(cwd) if cwd is not None else REPO_ROOT
    target = ["-m", str(script)] if module else [str(script)]
    full_env = worker_env(env)
    server = None if module else _forked(full_env)
    res: Optional[RunResult] = None
    for _attempt in range(2):
        if server is not None:
            res = _torchrun_forked(server, script, args, nproc, timeout, full_env, cwd)
            if res.returncode == 0 or "Address already in use" not in res.output:
                break
            continue
        port = free_port()
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(port),
            *target, *map(str, args),
        ]
        res = _run(cmd, timeout, full_env, cwd)
        if res.returncode == 0 or "Address already in use" not in res.output:
            break
    assert res is not None
    return res


_SHARED: dict = {}


def shared_torchrun(script: str | os.PathLike, args: Sequence[str] = (), *, nproc: int = 2,
                    timeout: float = 300.0, env: Optional[Mapping[str, str]] = None) -> RunResult:
    """:func:`run_torchrun`, launched once per ``(script, args, nproc, env)`` in this pytest process.

    For workers that run many checks in one process group: every test that needs a check of the
    launch reads its result from the same run (a failed or timed-out launch is reported by every
    test that uses it, never re-run). Each process group start costs seconds of imports per rank;
    one launch for a module's checks instead of one per test is most of a multi-rank module's time.
    """
    key = (str(script), tuple(map(str, args)), nproc, tuple(sorted((env or {}).items())))
    if key not in _SHARED:
        _SHARED[key] = run_torchrun(script, args, nproc=nproc, timeout=timeout, env=env)
    return _SHARED[key]


def result_rows(res: RunResult, tag: Optional[str] = None) -> list:
    """The JSON payloads of a worker's ``RESULT [tag] {json}`` lines (only those of ``tag`` if given)."""
    rows = []
    for line in res.stdout.splitlines():
        if not line.startswith("RESULT "):
            continue
        body = line[len("RESULT "):]
        if tag is not None:
            head, _, body = body.partition(" ")
            if head != tag:
                continue
        rows.append(json.loads(body))
    return rows


@dataclass
class RankResult:
    """Outcome of one rank of :func:`run_ranks`: ``returncode`` (``None``: killed at the deadline),
    ``stdout``, ``stderr``, and ``end_time`` (``time.time()`` when it exited, ``None`` if killed)."""

    rank: int
    returncode: Optional[int]
    stdout: str
    stderr: str
    end_time: Optional[float]

    def tail(self, n: int = 3000) -> str:
        return (f"rank {self.rank}: rc={self.returncode}\n--- stdout ---\n{self.stdout[-n:]}\n"
                f"--- stderr ---\n{self.stderr[-n:]}")


def run_ranks(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    nproc: int = 2,
    timeout: float = 120.0,
    wait_for: Optional[Sequence[int]] = None,
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[str | os.PathLike] = None,
) -> list[RankResult]:
    """Start ``nproc`` ranks of ``python script *args`` directly (``env://``: ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR/PORT``), without ``torch.distributed.run``.

    For fault tests: torchrun stops every rank as soon as one fails, which would hide what the
    survivors do on their own; here each rank's exit status and exit time are its own.

    Args:
        wait_for: the ranks to wait for (default: all); once they have exited (or at ``timeout``
            seconds), every rank still running is killed (SIGKILL to its process group) and
            reported with ``returncode=None``.
        timeout: hard limit in seconds for the whole run.

    Returns:
        one :class:`RankResult` per rank, in rank order.
    """
    cwd = Path(cwd) if cwd is not None else REPO_ROOT
    wait_for = list(range(nproc)) if wait_for is None else list(wait_for)
    results: list[RankResult] = []
    server = _forked(worker_env(env))
    for _attempt in range(2):
        port = free_port()
        with tempfile.TemporaryDirectory() as tmp:
            procs, files = [], []
            for r in range(nproc):
                out, err = open(os.path.join(tmp, f"{r}.out"), "w+"), open(os.path.join(tmp, f"{r}.err"), "w+")
                e = _rank_env(worker_env(env), r, nproc, port)
                if server is not None:
                    procs.append(ForkedProcess(server, script, args, e, cwd, out.name, err.name))
                else:
                    procs.append(subprocess.Popen([sys.executable, str(script), *map(str, args)], stdout=out,
                                                  stderr=err, text=True, env=e, cwd=str(cwd), start_new_session=True))
                files.append((out, err))
            ends: dict[int, float] = {}
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and not all(r in ends for r in wait_for):
                for r, p in enumerate(procs):
                    if r not in ends and p.poll() is not None:
                        ends[r] = time.time()
                time.sleep(0.05)
            for r, p in enumerate(procs):
                if r not in ends and p.poll() is not None:
                    ends[r] = time.time()
                if r not in ends:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                p.wait()
            results = []
            for r, (p, (out, err)) in enumerate(zip(procs, files)):
                out.seek(0)
                err.seek(0)
                results.append(RankResult(r, p.returncode if r in ends else None, out.read(), err.read(), ends.get(r)))
                out.close()
                err.close()
        if not any("Address already in use" in res.stderr for res in results):
            break
    return results


def run_python(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    timeout: float = 300.0,
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[str | os.PathLike] = None,
) -> RunResult:
    """Run ``python script *args`` (single process, same environment rules as :func:`run_torchrun`)."""
    cwd = Path(cwd) if cwd is not None else REPO_ROOT
    full_env = worker_env(env)
    server = _forked(full_env)
    if server is not None:
        return _run_forked(server, script, args, timeout, full_env, cwd)
    cmd = [sys.executable, str(script), *map(str, args)]
    return _run(cmd, timeout, full_env, cwd)


def run_reaped(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    nproc: Optional[int] = None,
    timeout: float = 300.0,
    env: Optional[Mapping[str, str]] = None,
) -> RunResult:
    """Like :func:`run_python` (``nproc=None``) or :func:`run_torchrun`, for runs that may be killed.

    Waits for the main process only (its output goes through files, not pipes) and then SIGKILLs
    what is left of its session: a process killed with SIGKILL leaves its helper processes (e.g.
    the checkpoint writer's multiprocessing manager) running, and they would hold a pipe open.
    ``returncode`` is ``-9`` for a SIGKILLed plain ``python`` run.
    """
    full_env = worker_env(env)
    server = _forked(full_env)
    if server is not None:
        if nproc is None:
            return _run_forked(server, script, args, timeout, full_env, REPO_ROOT)
        return _torchrun_forked(server, script, args, nproc, timeout, full_env, REPO_ROOT)
    if nproc is None:
        cmd = [sys.executable, str(script), *map(str, args)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *map(str, args)]
    with tempfile.TemporaryFile("w+") as fo, tempfile.TemporaryFile("w+") as fe:
        p = subprocess.Popen(cmd, stdout=fo, stderr=fe, text=True, env=full_env, cwd=str(REPO_ROOT),
                             start_new_session=True)
        try:
            rc: Optional[int] = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if rc is None:
            p.wait()
        fo.seek(0)
        fe.seek(0)
        return RunResult(cmd, rc, fo.read(), fe.read(), timed_out=rc is None)


def start_process_group(backend: str = "gloo"):
    """Start a torchrun worker's default group and return the device its ring runs on.

    ``"gloo"``: the CPU. ``"nccl"``: ``cuda:LOCAL_RANK``, set as the current device before the
    group starts (multi-GPU machines). The counterpart of :func:`finish_process_group`.
    """
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend)
    return device


def finish_process_group() -> None:
    """End a worker: barrier on the default group, flush stdout/stderr, then leave the process with
    ``os._exit(0)``.

    Without the barrier a fast rank can tear down its gloo pairs (and exit) while a slow rank is
    still finishing its last collective or printing, and the slow rank then aborts (SIGABRT) on the
    closed connection. After the barrier no collective is pending, so the group's teardown is
    skipped: ``destroy_process_group`` and the interpreter's exit-time destructors of the gloo
    groups (several per worker with megatron's hierarchical groups) have aborted a rank with
    ``terminate called without an active exception`` after every check had passed. The OS closes
    the sockets. Call it once, as the very last statement of every torchrun worker (exit code 0).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def one_rank_megatron(backend: str = "gloo"):
    """A one-rank default group and megatron-core's parallel state (TP = CP = 1) inside this
    process, for in-process model tests; torn down afterwards.

    The group starts from a ``tcp://`` address on a free port, so nothing is written into
    ``os.environ``: ``MASTER_ADDR``/``MASTER_PORT`` left there would be inherited by every later
    subprocess of the test session, which would then try to listen on the port this process holds.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    own = not dist.is_initialized()
    if own:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        if own:
            dist.destroy_process_group()
