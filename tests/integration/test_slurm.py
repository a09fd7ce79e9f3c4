"""The Slurm scripts in examples/slurm/ really run: a private Slurm cluster on this machine.

``tools/local_slurm.sh`` installs Debian's ``slurm-wlm`` + ``munge`` when they are missing (root +
apt-get; CI-friendly: nothing else to set up) and starts munged, slurmctld and two slurmd daemons
(two emulated nodes on localhost, ``node1``/``node2``) with all state in a temp folder; the
fixture stops them afterwards. Then, in CPU mode (gloo, tiny model, a tiny dataset built here with
a trained sentencepiece model + ``tools/preprocess_data.py``):

* ``train_single_node.sbatch`` on one node, 2 Slurm tasks = 2 ranks (CP=2);
* ``train_multinode.sbatch`` on both nodes, one task per node running torchrun (2 ranks each, CP=4,
  node ranks from ``$SLURM_NODEID``) with a flat (non-hierarchical) config: no hierarchical flag;
* preemption: a job gets ``scancel --signal=USR1`` mid-run, saves, exits 0 and requeues itself; the
  requeued job (same id) resumes from that checkpoint; a second job with the same job name
  (``--dependency=singleton``) resumes where the first one stopped (``--exit-interval``). Both loss
  curves equal an uninterrupted run's, iteration by iteration.

Each job must finish COMPLETED with exit code 0 and its log must show Megatron iteration lines
(`` iteration        1/``) and a saved checkpoint. Skipped, with the reason, only when a Slurm
cluster cannot be started here: not root, or slurm-wlm/munge missing and not installable (no
apt-get / no access to the Debian archive). ``MTRAINING_SKIP_SLURM=1`` skips on purpose.
Jobs are submitted together and run side by side (4 CPUs per emulated node, ``--oversubscribe``).
Runtime on the 2-core machine, busy: about 4 minutes (+ ~20 s for apt-get the first time).

Without Slurm: the flags the scripts pass exist, the scripts parse, the time-limit parser, and the
launch command the scripts build for a 4-node x 8-GPU job (``DRY_RUN=1`` with the Slurm variables of
such a job): hierarchical flag only for a hierarchical config, ranks from the GPUs of the
allocation, master port below the ephemeral range, ``SRUN_EXTRA_ARGS``, outputs outside the
repository, ``--load`` exactly when the stable run folder holds a checkpoint.
"""

from __future__ import annotations

import json
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
    body = src[src.index("mt_build_args() {"):src.index("mt_launch() {")]
    used = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", body))
    probed = {"--mtraining-config", "--hierarchical-context-parallel-sizes", "--help", "--pretrain-flags"}
    assert used - probed, "no flags found"
    assert not (used - probed - accepted), f"flags pretrain_gpt.py does not accept: {sorted(used - probed - accepted)}"
    for script in ("train_single_node.sbatch", "train_multinode.sbatch", "common.sh"):
        r = subprocess.run(["bash", "-n", str(ROOT / "examples/slurm" / script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    from tests.helpers.tiny_data import make_tiny_dataset

    return make_tiny_dataset(tmp_path_factory.mktemp("dry_run_data"))


def _dry_run(files, tmp_path: Path, script: str, **env) -> subprocess.CompletedProcess:
    """``DRY_RUN=1`` run of an sbatch script outside Slurm with the given Slurm variables of a job."""
    prefix, tok = files
    base = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home"), "DRY_RUN": "1", "PYTHON": sys.executable,
            "PYTHONPATH": str(ROOT), "MTRAINING_REPO": str(ROOT), "DATA_PREFIX": prefix, "TOKENIZER_MODEL": tok,
            "SLURM_JOB_ID": "123456", "SLURM_JOB_NAME": "qwen-512k", "SLURM_JOB_NODELIST": "gpu[01-04]",
            "MASTER_ADDR": "gpu01"}
    return subprocess.run(["bash", str(ROOT / "examples/slurm" / script)], capture_output=True, text=True,
                          cwd=ROOT, env={**base, **env}, timeout=120)


def _launch_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("mtraining sbatch: dry run:")]
    assert len(lines) == 1, r.stdout
    return lines[0]


def test_time_left_parser():
    """``squeue -o %L`` / ``--time`` formats -> whole minutes; unlimited -> nothing."""
    cases = {"59:59": "59", "1:00:00": "60", "04:00:00": "240", "1-00:00:00": "1440", "2-03": "3060",
             "1-02:03": "1563", "0:30": "0", "7": "7", "UNLIMITED": "", "NOT_SET": "", "": ""}
    script = f"source {ROOT / 'examples/slurm/common.sh'}; " + "; ".join(
        f"echo \"[$(mt_minutes '{k}')]\"" for k in cases)
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"[{v}]" for v in cases.values()]


def test_dry_run_4_nodes_x_8_gpus(tiny_files, tmp_path):
    """The paper's 4 x 8 GPU shape: torchrun per node with 8 ranks, CP 32, hierarchical 8 x 4 from the
    hierarchical config; the same job with a flat config has no hierarchical flag (it failed before)."""
    job = {"SLURM_NNODES": "4", "SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": "1",
           "OUTPUT_DIR": str(tmp_path / "out"), "SRUN_EXTRA_ARGS": "--mpi=pmix --container-image=img.sqsh",
           "EXIT_DURATION_MINS": "1430"}
    r = _dry_run(tiny_files, tmp_path, "train_multinode.sbatch", MTRAINING_CONFIG="configs/qwen2.5-3b-512k.yaml", **job)
    line = _launch_line(r)
    assert "world 32 = TP 1 x CP 32 x DP 1" in r.stdout
    assert "the arguments pass the checks of pretrain_gpt.py (world size 32; dry run)" in r.stdout
    assert not (tmp_path / "out").exists()               # a dry run creates no run folder
    assert "--nodes=4 --ntasks=4 --ntasks-per-node=1 --mpi=pmix --container-image=img.sqsh bash" in line
    assert "--context-parallel-size 32" in line and "--hierarchical-context-parallel-sizes 8 4" in line
    assert "--exit-duration-in-mins 1430 --exit-signal-handler --exit-signal SIGUSR1" in line
    port = int(re.search(r"master gpu01:(\d+)", r.stdout).group(1))
    assert 1024 < port < 32768 and port == 15000 + 123456 % 15000
    # stable run folder from the job name, under OUTPUT_DIR; nothing to resume yet
    assert f"--save {tmp_path}/out/qwen-512k/checkpoints" in line and "--load" not in line
    # the flat launch that configs/qwen2.5-0.5b.yaml documents (4 nodes, CP 32)
    flat = _launch_line(_dry_run(tiny_files, tmp_path, "train_multinode.sbatch",
                                 MTRAINING_CONFIG="configs/qwen2.5-0.5b.yaml", MODEL="qwen2.5-0.5b", **job))
    assert "--mtraining-config configs/qwen2.5-0.5b.yaml" in flat and "--context-parallel-size 32" in flat
    assert "--hierarchical-context-parallel-sizes" not in flat
    # HIERARCHICAL_CP=1 against a flat config is an error naming both
    r = _dry_run(tiny_files, tmp_path, "train_multinode.sbatch", MTRAINING_CONFIG="configs/demo.yaml",
                 HIERARCHICAL_CP="1", **job)
    assert r.returncode != 0 and "HIERARCHICAL_CP=1 but configs/demo.yaml has implementation: striped" in r.stderr
    # a config with its own sizes (8 x 4) on 2 nodes (CP 16): refused before anything starts
    r = _dry_run(tiny_files, tmp_path, "train_multinode.sbatch", MTRAINING_CONFIG="configs/hierarchical.yaml",
                 **{**job, "SLURM_NNODES": "2"})
    assert r.returncode != 0 and "hierarchical inner x outer = 8 x 4 != CP=16" in r.stderr, r.stderr


def test_dry_run_ranks_follow_the_gpus_of_the_allocation(tiny_files, tmp_path):
    """``sbatch --gpus-per-node=4`` of the 8-task single-node script starts 4 ranks, not 8."""
    job = {"SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "8", "OUTPUT_DIR": str(tmp_path / "out"),
           "EXIT_DURATION_MINS": "0"}
    for gpus in ({"SLURM_GPUS_ON_NODE": "4"}, {"SLURM_GPUS_PER_NODE": "h100:4"}):
        r = _dry_run(tiny_files, tmp_path, "train_single_node.sbatch", **job, **gpus)
        line = _launch_line(r)
        assert "--ntasks=4 --ntasks-per-node=4" in line and "--context-parallel-size 4" in line, line
        assert "--exit-duration-in-mins" not in line
    r = _dry_run(tiny_files, tmp_path, "train_single_node.sbatch", **{**job, "SLURM_NTASKS_PER_NODE": "2"},
                 SLURM_GPUS_ON_NODE="4")
    assert r.returncode != 0 and "4 GPUs but 2 tasks per node: submit with --ntasks-per-node=4" in r.stderr


def test_dry_run_of_a_gpu_launch_on_a_machine_without_a_gpu(tiny_files, tmp_path):
    """A login node has no GPU: the dry run checks the launch as the GPU ranks would, so a config on the
    Triton kernels with CUDA graphs passes at one GPU (it was refused as a CPU run) and is refused at CP 2
    (the graphs' own rule)."""
    job = {"SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "1", "OUTPUT_DIR": str(tmp_path / "out"),
           "EXIT_DURATION_MINS": "0", "MTRAINING_CONFIG": "configs/long_context_r098_graphs.yaml"}
    r = _dry_run(tiny_files, tmp_path, "train_single_node.sbatch", SLURM_GPUS_ON_NODE="1", **job)
    assert "--mtraining-config configs/long_context_r098_graphs.yaml" in _launch_line(r)
    r = _dry_run(tiny_files, tmp_path, "train_single_node.sbatch", SLURM_GPUS_ON_NODE="2",
                 **{**job, "SLURM_NTASKS_PER_NODE": "2"})
    assert r.returncode == 1 and "'cuda_graphs: true' needs context-parallel size 1" in r.stderr, r.stdout + r.stderr


def test_dry_run_outputs_outside_the_repository_and_load_when_a_checkpoint_exists(tiny_files, tmp_path):
    job = {"SLURM_NNODES": "1", "SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": "8", "EXIT_DURATION_MINS": "0"}
    r = _dry_run(tiny_files, tmp_path, "train_single_node.sbatch", **job)            # no OUTPUT_DIR, no SCRATCH: $HOME
    line = _launch_line(r)
    ckpt = tmp_path / "home" / "mtraining-runs" / "qwen-512k" / "checkpoints"
    assert f"--save {ckpt}" in line and "--load" not in line, line
    assert not (tmp_path / "home").exists()              # a dry run creates nothing
    assert "OUTPUT_DIR not set: runs go to" in r.stdout
    r = _dry_run(tiny_files, tmp_path, "train_single_node.sbatch", SCRATCH=str(tmp_path / "scratch"),
                 RUN_NAME="run-a", **job)
    assert f"--save {tmp_path}/scratch/mtraining-runs/run-a/checkpoints" in _launch_line(r)
    # a checkpoint in the stable folder: a new job (another id) of the same name passes --load
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("200")
    r = _dry_run(tiny_files, tmp_path, "train_single_node.sbatch", **{**job, "SLURM_JOB_ID": "999"})
    assert f"--load {ckpt}" in _launch_line(r) and "latest_checkpointed_iteration.txt: 200" in r.stdout
    # a finished run (checkpoint at TRAIN_ITERS, e.g. the last job of a chain) launches nothing, even
    # without DRY_RUN (outside an allocation srun would fail)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1000")
    r = _dry_run(tiny_files, tmp_path, "train_single_node.sbatch", **{**job, "DRY_RUN": "0", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "is at iteration 1000 of 1000 already: nothing to train" in r.stdout


def test_dry_run_refuses_what_the_trainer_would_and_creates_nothing(tiny_files, tmp_path):
    """CPU mode, SEQ_LENGTH=1000 on CP 2: pretrain_gpt.py's own argument check refuses it in the dry run
    (the striped layout cannot split it), before the launch line, and no run folder appears."""
    r = _dry_run(tiny_files, tmp_path, "train_single_node.sbatch", MTRAINING_CPU="1", SLURM_NNODES="1",
                 SLURM_NTASKS_PER_NODE="2", SEQ_LENGTH="1000", OUTPUT_DIR=str(tmp_path / "out"), EXIT_DURATION_MINS="0")
    assert r.returncode == 1, r.stdout + r.stderr
    assert ("mtraining sbatch: error: pretrain_gpt.py would refuse this command line (dry run): --seq-length 1000 "
            "with --context-parallel-size 2") in r.stderr and "divisible by" in r.stderr, r.stderr
    assert "dry run:" not in r.stdout                    # no launch line
    assert not (tmp_path / "out").exists()
    # a config the trainer would refuse: its error, naming the keys, before anything starts
    bad = tmp_path / "bad.yaml"
    bad.write_text("pattern: vertical_slash\nkernel_backend: sdpa\n")
    r = _dry_run(tiny_files, tmp_path, "train_single_node.sbatch", MTRAINING_CPU="1", SLURM_NNODES="1",
                 SLURM_NTASKS_PER_NODE="2", MTRAINING_CONFIG=str(bad), OUTPUT_DIR=str(tmp_path / "out"),
                 EXIT_DURATION_MINS="0")
    assert r.returncode == 1 and "'kernel_backend: sdpa' has no sparse kernels" in r.stderr, r.stdout + r.stderr
    assert f"bad MTRAINING_CONFIG={bad}" in r.stderr and "dry run:" not in r.stdout


def test_cpu_mode_default_seq_length_splits_for_every_cp():
    """The tiny model's default SEQ_LENGTH: 256, or the smallest multiple of CP x 64 above it (CP 8 of
    8 CPU tasks cannot split 256 tokens in 64-token stripes). mt_build_args itself, with a stub interpreter."""
    script = (f"source {ROOT / 'examples/slurm/common.sh'}; "
              "for cp in 1 2 3 4 8; do (CP=$cp; mt_build_args >/dev/null; echo $SEQ_LENGTH); done")
    env = {"PATH": os.environ["PATH"], "PYTHON": "true", "PRETRAIN": "pretrain_gpt.py", "MTRAINING_CPU": "1",
           "TP": "1", "DP": "1", "BACKEND": "gloo", "DATA_PREFIX": "d", "TOKENIZER_MODEL": "t", "CKPT_DIR": "c",
           "RESUME_ITER": "", "EXIT_DURATION_MINS": "0"}
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["256", "256", "384", "256", "512"]


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
                 _job_env(dataset, multi / "run", MTRAINING_CPU_PROCS="2", MTRAINING_CONFIG="configs/demo.yaml"),
                 multi)
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
    # a flat config on 2 nodes is a flat ring: no hierarchical flag from the node count
    assert "flat CP ring (configs/demo.yaml: implementation striped)" in log, log[:3000]
    assert "--hierarchical-context-parallel-sizes" not in log, log[:3000]
    _check_training_log(log, run_dir)
    # one torchrun per node, each with its own node rank
    assert sorted(p.name for p in (run_dir / "logs" / "torchrun").iterdir()) == ["node0", "node1"]


# --------------------------------------------------------------------- preemption, requeue, resume
RESUME_ITERS = 20     # 8 micro-batches per iteration: a few seconds of training, long enough to signal
HALF = RESUME_ITERS // 2      # where the first job of the singleton chain stops (--exit-interval)


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _state(env, jid: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", jid, "-o", "%T"], capture_output=True, text=True, env=env,
                          timeout=30).stdout.strip()


@pytest.fixture(scope="module")
def resume_jobs(slurm, dataset, tmp_path_factory):
    """Three runs of the same training (RESUME_ITERS iterations, CP=2, 2 ranks) under one OUTPUT_DIR:
    ``ref`` uninterrupted; ``sig`` gets SIGUSR1 (the test sends it) and requeues itself;
    ``chain`` = two jobs of the same name, the second with --dependency=singleton, the first
    stopping at iteration HALF (--exit-interval HALF)."""
    d = tmp_path_factory.mktemp("resume")
    out = d / "out"
    common = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--oversubscribe", "--time=10"]
    script = ROOT / "examples/slurm/train_single_node.sbatch"

    def env(name, **extra):
        job = _job_env(dataset, out / "unused", OUTPUT_DIR=str(out), TRAIN_ITERS=str(RESUME_ITERS),
                       GLOBAL_BATCH_SIZE="8", EXIT_MARGIN_MINS="1", **extra)
        job.pop("RUN_DIR")                    # the stable folder OUTPUT_DIR/RUN_NAME (default: job name)
        job["EXTRA_ARGS"] = f"--metrics-file {d / name}.jsonl {extra.get('EXTRA_ARGS', '')}"
        return job

    jobs = {"ref": _submit(slurm, [*common, "--job-name=ref"], script, env("ref"), d),
            "sig": _submit(slurm, [*common, "--job-name=sig"], script, env("sig"), d),
            "chain1": _submit(slurm, [*common, "--job-name=chain"], script,
                              env("chain", AUTO_REQUEUE="0", EXTRA_ARGS=f"--exit-interval {HALF}"), d)}
    jobs["chain2"] = _submit(slurm, [*common, "--job-name=chain", "--dependency=singleton"], script,
                             env("chain", AUTO_REQUEUE="0", EXTRA_ARGS=f"--exit-interval {HALF}"), d)
    yield jobs, d, out
    subprocess.run(["scancel", *jobs.values()], env=slurm, capture_output=True, timeout=30)


def _same_curve(run: list[dict], ref: list[dict]) -> None:
    assert [x["iteration"] for x in run] == list(range(1, RESUME_ITERS + 1)), [x["iteration"] for x in run]
    for x, y in zip(ref, run):
        assert y["lr"] == pytest.approx(x["lr"], rel=1e-12), (x, y)
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=1e-6), (x, y)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-6), (x, y)


@pytest.mark.slow
def test_signal_saves_exits_0_and_the_requeued_job_resumes_the_same_curve(slurm, resume_jobs):
    jobs, d, out = resume_jobs
    jid = jobs["sig"]
    log_file = d / f"sig-{jid}.out"
    t0 = time.monotonic()
    while not (log_file.exists() and " iteration        3/" in log_file.read_text(errors="replace")):
        assert time.monotonic() - t0 < 240 and _state(slurm, jid) in ("PENDING", "RUNNING", "CONFIGURING"), (
            log_file.read_text(errors="replace")[-3000:] if log_file.exists() else "no log")
        time.sleep(0.3)
    subprocess.run(["scancel", "--signal=USR1", jid], env=slurm, check=True, timeout=30)
    # the job requeues itself; Slurm holds a requeued job ~2 minutes (BeginTime): release it now
    t0 = time.monotonic()
    while "requeueing job" not in log_file.read_text(errors="replace") or _state(slurm, jid) != "PENDING":
        assert time.monotonic() - t0 < 120, log_file.read_text(errors="replace")[-3000:]
        time.sleep(0.5)
    # not within the second of the requeue: slurmd refuses a start there ("Job credential revoked",
    # the previous run's credential is revoked at that second)
    time.sleep(2.0)
    subprocess.run(["scontrol", "update", f"JobId={jid}", "StartTime=now"], env=slurm, timeout=30)
    log = _wait(slurm, jid, d)
    info = subprocess.run(["scontrol", "show", "job", jid], capture_output=True, text=True, env=slurm).stdout
    assert "Restarts=1" in info, info
    m = re.search(r"exiting after iteration (\d+) \(SIGUSR1 received, --exit-signal-handler\)", log)
    assert m, log[-4000:]
    k = int(m.group(1))
    assert 3 <= k < RESUME_ITERS
    assert f"saved checkpoint {out}/sig/checkpoints/iter_{k:07d}" in log
    assert f"stopped at iteration {k} of {RESUME_ITERS}: requeueing job {jid}" in log
    # the requeued run (restart 1) found the checkpoint in the stable folder and loaded it
    assert f"job {jid} (restart 1)" in log and f"latest_checkpointed_iteration.txt: {k}); --load" in log
    assert f"loaded checkpoint {out}/sig/checkpoints/iter_{k:07d} (iteration {k})" in log
    # from the 10-minute limit (read a few seconds into the job: 9 or 10 whole minutes left), minus the margin
    limits = re.findall(r"time limit: (\d+) min left; --exit-duration-in-mins (\d+) \(EXIT_MARGIN_MINS=1\)", log)
    assert len(limits) == 2 and all(left in ("9", "10") and int(mins) == int(left) - 1 for left, mins in limits), limits
    assert (out / "sig" / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == str(RESUME_ITERS)
    _wait(slurm, jobs["ref"], d)
    _same_curve(_metrics(d / "sig.jsonl"), _metrics(d / "ref.jsonl"))


@pytest.mark.slow
def test_a_new_job_of_the_same_name_resumes_the_run(slurm, resume_jobs):
    """--dependency=singleton chain: job 2 (a new job id) resumes job 1's checkpoint of iteration HALF
    from OUTPUT_DIR/<job name> and the two halves are the uninterrupted curve."""
    jobs, d, out = resume_jobs
    log1 = _wait(slurm, jobs["chain1"], d)
    assert f"exiting after iteration {HALF} (--exit-interval {HALF})" in log1
    assert f"stopped at iteration {HALF} of {RESUME_ITERS}: submit again with the same RUN_NAME" in log1
    log2 = _wait(slurm, jobs["chain2"], d)
    assert f"latest_checkpointed_iteration.txt: {HALF}); --load {out}/chain/checkpoints" in log2, log2[:3000]
    assert f"loaded checkpoint {out}/chain/checkpoints/iter_{HALF:07d} (iteration {HALF})" in log2
    assert f"done: {out}/chain (iteration {RESUME_ITERS})" in log2
    _wait(slurm, jobs["ref"], d)
    _same_curve(_metrics(d / "chain.jsonl"), _metrics(d / "ref.jsonl"))
