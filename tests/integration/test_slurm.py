"""The Slurm scripts in examples/slurm/ really run: a private Slurm cluster on this machine.

``tools/local_slurm.sh`` installs Debian's ``slurm-wlm`` + ``munge`` when they are missing (root +
apt-get; CI-friendly: nothing else to set up) and starts munged, slurmctld and two slurmd daemons
(two emulated nodes on localhost, ``node1``/``node2``) with all state in a temp folder; the
fixture stops them afterwards. Then, in CPU mode (gloo, tiny model, 3 iterations, a tiny dataset
built here with a trained sentencepiece model + ``tools/preprocess_data.py``):

* ``train_single_node.sbatch`` on one node, 2 Slurm tasks = 2 ranks (CP=2);
* ``train_multinode.sbatch`` on both nodes, one task per node running torchrun (2 ranks each, CP=4,
  node ranks from ``$SLURM_NODEID``).

Each job must finish COMPLETED with exit code 0 and its log must show Megatron iteration lines
(`` iteration        1/``) and a saved checkpoint. Skipped, with the reason, only when a Slurm
cluster cannot be started here: not root, or slurm-wlm/munge missing and not installable (no
apt-get / no access to the Debian archive). ``MTRAINING_SKIP_SLURM=1`` skips on purpose.
Both jobs are submitted together and run side by side (4 CPUs per emulated node, ``--oversubscribe``).
Runtime on the 2-core machine, busy: about 1.5 minutes (+ ~20 s for apt-get the first time).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCAL_SLURM = ROOT / "tools" / "local_slurm.sh"
ITER_RE = re.compile(r" iteration +(\d+)/ +(\d+) \|")



def test_scripts_use_only_flags_that_pretrain_gpt_accepts():
    """Always on (no Slurm needed): every flag the sbatch scripts pass exists in
    ``examples/pretrain_gpt.py --help``, except the two they probe for first."""
    help_text = subprocess.run([sys.executable, str(ROOT / "examples/pretrain_gpt.py"), "--help"],
                               capture_output=True, text=True, timeout=120, cwd=ROOT).stdout
    accepted = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", help_text))
    src = (ROOT / "examples/slurm/common.sh").read_text()
    body = src[src.index("mt_build_args() {"):]
    used = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", body))
    probed = {"--mtraining-config", "--hierarchical-context-parallel-sizes", "--help", "--pretrain-flags"}
    assert used - probed, "no flags found"
    assert not (used - probed - accepted), f"flags pretrain_gpt.py does not accept: {sorted(used - probed - accepted)}"
    for script in ("train_single_node.sbatch", "train_multinode.sbatch", "common.sh"):
        r = subprocess.run(["bash", "-n", str(ROOT / "examples/slurm" / script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def _skip_reason() -> str | None:
    if os.environ.get("MTRAINING_SKIP_SLURM") == "1":
        return "MTRAINING_SKIP_SLURM=1"
    if sys.platform != "linux":
        return f"Slurm test needs Linux (platform {sys.platform})"
    if os.geteuid() != 0:
        return ("not root: tools/local_slurm.sh runs munged/slurmctld/slurmd as root "
                "(and installs slurm-wlm/munge with apt-get)")
    have = all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged"))
    if not have and not shutil.which("apt-get"):
        return "slurm-wlm/munge are not installed and apt-get is not available to install them"
    return None


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running 2-node (emulated) Slurm cluster; yields the environment for sbatch/squeue."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    inst = subprocess.run(["bash", str(LOCAL_SLURM), "install"], capture_output=True, text=True, timeout=900)
    if inst.returncode != 0:
        pytest.skip("could not install slurm-wlm/munge: " + (inst.stderr.strip().splitlines() or ["?"])[-1])
    d = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, SLURM_NODES="2", SLURM_CPUS="4")
    start = subprocess.run(["bash", str(LOCAL_SLURM), "start", str(d)], capture_output=True, text=True,
                           timeout=180, env=env)
    try:
        assert start.returncode == 0, f"local Slurm did not start:\n{start.stdout}\n{start.stderr}"
        env = dict(os.environ, SLURM_CONF=str(d / "slurm.conf"))
        env.pop("SLURM_NODES", None)
        for k in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            env.pop(k)  # a test run inside a Slurm job must not leak that job's variables
        yield env
    finally:
        subprocess.run(["bash", str(LOCAL_SLURM), "stop", str(d)], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from tests.helpers.tiny_dataset import build

    return build(tmp_path_factory.mktemp("data"))


def _submit(env, sbatch_args, script, job_env, out_dir: Path) -> str:
    cmd = ["sbatch", "--parsable", f"--output={out_dir}/%x-%j.out", *sbatch_args, str(script)]
    sub = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**env, **job_env}, timeout=60)
    assert sub.returncode == 0, f"sbatch failed: {sub.stderr}"
    return sub.stdout.strip().split(";")[0]


def _wait(env, jid: str, out_dir: Path, timeout: float = 240) -> str:
    """Wait for the job to leave the queue; it must be COMPLETED with exit code 0. Returns its log."""
    t0 = time.monotonic()
    while True:
        q = subprocess.run(["squeue", "-h", "-j", jid, "-o", "%T"], capture_output=True, text=True, env=env,
                           timeout=30)
        if not q.stdout.strip():
            break
        if time.monotonic() - t0 > timeout:
            subprocess.run(["scancel", jid], env=env, timeout=30)
            logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in out_dir.glob(f"*-{jid}.out"))
            pytest.fail(f"job {jid} still {q.stdout.strip()} after {timeout} s; log tail:\n{logs}")
        time.sleep(2)
    info = subprocess.run(["scontrol", "show", "job", jid], capture_output=True, text=True, env=env,
                          timeout=30).stdout
    logs = list(out_dir.glob(f"*-{jid}.out"))
    assert len(logs) == 1, f"no job log for {jid} in {out_dir}"
    log = logs[0].read_text(errors="replace")
    print(f"--- job {jid} ---\n{log}")
    assert "JobState=COMPLETED" in info and "ExitCode=0:0" in info, f"{info}\n--- log ---\n{log[-4000:]}"
    return log


def _check_training_log(log: str, run_dir: Path, iters: int = 3) -> None:
    assert " iteration        1/" in log, log[-4000:]
    seen = sorted({int(m.group(1)) for m in ITER_RE.finditer(log)})
    assert seen == list(range(1, iters + 1)), (seen, log[-4000:])
    assert "training done" in log and "saved checkpoint" in log
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(iters)
    assert " iteration        1/" in (run_dir / "logs" / "train.log").read_text()


def _job_env(dataset, run_dir: Path, **extra) -> dict:
    prefix, model = dataset
    return {"MTRAINING_CPU": "1", "DATA_PREFIX": str(prefix), "TOKENIZER_MODEL": str(model),
            "RUN_DIR": str(run_dir), "PYTHON": sys.executable, "MTRAINING_REPO": str(ROOT), **extra}


@pytest.fixture(scope="module")
def jobs(slurm, dataset, tmp_path_factory):
    """Submit both scripts at once (they run side by side: 4 CPUs per emulated node and
    --oversubscribe overriding the scripts' --exclusive); each test waits for its job."""
    single = tmp_path_factory.mktemp("single")
    multi = tmp_path_factory.mktemp("multi")
    j1 = _submit(slurm, ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--oversubscribe"],
                 ROOT / "examples/slurm/train_single_node.sbatch",
                 _job_env(dataset, single / "run", MTRAINING_CONFIG="configs/demo.yaml"), single)
    j2 = _submit(slurm, ["--nodes=2", "--gpus-per-node=0", "--oversubscribe"],
                 ROOT / "examples/slurm/train_multinode.sbatch",
                 _job_env(dataset, multi / "run", MTRAINING_CPU_PROCS="2"), multi)
    yield {"single": (j1, single), "multi": (j2, multi)}
    subprocess.run(["scancel", j1, j2], env=slurm, capture_output=True, timeout=30)


@pytest.mark.slow
def test_single_node_sbatch_cpu_mode(slurm, jobs):
    jid, d = jobs["single"]
    log = _wait(slurm, jid, d)
    assert "world 2 = TP 1 x CP 2 x DP 1" in log and "backend gloo" in log
    assert re.search(r"^[01]: ", log, flags=re.M), "srun -l task prefixes missing"
    _check_training_log(log, d / "run")


@pytest.mark.slow
def test_multinode_sbatch_cpu_mode_two_nodes(slurm, jobs):
    jid, d = jobs["multi"]
    log = _wait(slurm, jid, d)
    run_dir = d / "run"
    assert "on 2 node(s)" in log and "world 4 = TP 1 x CP 4 x DP 1" in log
    # hierarchical sizes derived from the node layout: inner = 2 ranks per node, outer = 2 nodes
    assert ("hierarchical CP sizes would be 2 x 2" in log  # pretrain_gpt.py without the flag: flat ring
            or "hierarchical CP: inner 2 (in a node) x outer 2 (across nodes)" in log), log[:3000]
    _check_training_log(log, run_dir)
    # one torchrun per node, each with its own node rank
    assert sorted(p.name for p in (run_dir / "logs" / "torchrun").iterdir()) == ["node0", "node1"]
