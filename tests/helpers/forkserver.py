"""A fork server for the test suite's Python subprocesses: torch and megatron-core imported once.

Most of a test subprocess's time on a CPU machine is its imports (torch and megatron-core: about
6 s of one core per process, against well under a second of training in the trainer tests). The
server is one Python process per pytest process that imports them once and then forks a child per
launch; the child takes the launch's environment, working directory, ``sys.argv`` and output files
and runs the script as ``__main__`` (``runpy.run_path``), so it behaves like ``python SCRIPT ARGS``
started in its own session, with its own pid, exit status and signals.

Used by :mod:`tests.helpers.dist` (``run_python``, ``run_ranks``, ``run_reaped`` and
``run_torchrun``, whose ranks it starts directly, as torchrun would). A launch falls back to a
plain subprocess when its environment differs from the server's in a variable that is read at
import time (``TRITON_INTERPRET``, ``PYTHONPATH``, ``OMP_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES``),
on a machine with CUDA (no fork after a CUDA context), and with ``MTRAINING_TEST_FORKSERVER=0``.

Protocol (one JSON object per line on the server's stdin and stdout): ``{"op": "spawn", "script",
"args", "env", "cwd", "out", "err"}`` -> ``{"pid"}``; ``{"op": "poll", "pids"}`` ->
``{"done": {pid: returncode}}`` (negative: killed by that signal, as ``subprocess``).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
from typing import Mapping, Optional, Sequence

IMPORT_TIME_VARS = ("TRITON_INTERPRET", "PYTHONPATH", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
PRELOAD = ("numpy", "torch", "torch.distributed", "sentencepiece", "megatron.core",
           "megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs",
           "megatron.core.datasets.gpt_dataset", "megatron.core.datasets.blended_megatron_dataset_builder",
           "megatron.core.optimizer", "megatron.core.dist_checkpointing", "megatron.core.distributed",
           "megatron.core.tokenizers")


# ------------------------------------------------------------------------------------ server side
def _serve() -> int:
    import importlib
    import warnings

    warnings.filterwarnings("ignore")
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional module: the child imports what it needs itself
            pass
    out = sys.stdout
    out.write("READY\n")
    out.flush()
    children: dict[int, Optional[int]] = {}
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "spawn":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                return _child(req)
            children[pid] = None
            out.write(json.dumps({"pid": pid}) + "\n")
        elif req["op"] == "poll":
            done = {}
            for p in req["pids"]:
                if children.get(p) is None:
                    try:
                        wpid, status = os.waitpid(p, os.WNOHANG)
                    except ChildProcessError:
                        wpid, status = p, 0
                    if wpid == p:
                        children[p] = os.waitstatus_to_exitcode(status)
                if children.get(p) is not None:
                    done[str(p)] = children[p]
            out.write(json.dumps({"done": done}) + "\n")
        out.flush()
    return 0


def _child(req: dict):
    """In the forked child: become ``python SCRIPT ARGS`` in its own session, then run it."""
    import random
    import runpy

    os.setsid()
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, req["out"]), (2, req["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    random.seed()                                  # fresh entropy, as a new interpreter would have
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    script = os.path.abspath(req["script"])
    sys.argv = [req["script"], *req["args"]]
    sys.path[0] = os.path.dirname(script)          # `python SCRIPT` puts the script's folder first
    runpy.run_path(script, run_name="__main__")
    return 0


# ------------------------------------------------------------------------------------ client side
class _Server:
    def __init__(self, env: Mapping[str, str], cwd: str):
        self.env = dict(env)
        self.proc = subprocess.Popen([sys.executable, "-u", "-m", "tests.helpers.forkserver"], cwd=cwd,
                                     env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        if self.proc.stdout.readline().strip() != "READY":
            raise RuntimeError("the test fork server did not start")
        atexit.register(self.close)

    def ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the test fork server exited")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_SERVER: Optional[_Server] = None


def server_for(env: Mapping[str, str], cwd: str) -> Optional[_Server]:
    """The fork server that can start a process with ``env`` (started on first use), or ``None``
    where a plain subprocess must be used (see the module docstring)."""
    global _SERVER
    if os.environ.get("MTRAINING_TEST_FORKSERVER", "1") == "0" or not hasattr(os, "fork"):
        return None
    try:
        import torch

        if torch.cuda.is_available():
            return None
    except ImportError:
        return None
    if _SERVER is None or _SERVER.proc.poll() is not None:
        try:
            _SERVER = _Server(env, cwd)
        except (OSError, RuntimeError):
            return None
    if any(_SERVER.env.get(k) != env.get(k) for k in IMPORT_TIME_VARS):
        return None
    return _SERVER


class ForkedProcess:
    """A ``subprocess.Popen``-like handle of a process started by the fork server."""

    def __init__(self, server: _Server, script: str, args: Sequence[str], env: Mapping[str, str], cwd: str,
                 out: str, err: str):
        self.server = server
        self.pid = server.ask({"op": "spawn", "script": str(script), "args": [str(a) for a in args],
                               "env": dict(env), "cwd": str(cwd), "out": out, "err": err})["pid"]
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            done = self.server.ask({"op": "poll", "pids": [self.pid]})["done"]
            if str(self.pid) in done:
                self.returncode = done[str(self.pid)]
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.02)
        return self.returncode

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Signal the process's session (it and whatever it started)."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


if __name__ == "__main__":
    sys.exit(_serve())
