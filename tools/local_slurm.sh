#!/usr/bin/env bash
# A private single-node Slurm cluster on this machine (for tests/integration/test_slurm.py and for trying the
# sbatch scripts in examples/slurm/ without a cluster).
#
#   tools/local_slurm.sh install        install Debian's slurm-wlm + munge if missing (root + apt-get)
#   tools/local_slurm.sh start DIR      start munged, slurmctld, slurmd with all state under DIR;
#                                       prints `export SLURM_CONF=DIR/slurm.conf` (use it for sbatch,
#                                       squeue, scontrol, sacct-less job queries)
#   tools/local_slurm.sh stop DIR       stop the three daemons started for DIR (by their pid files)
#
# Requirements: root (slurmd runs jobs as the submitting user; munged needs --force as root), Debian
# packages slurm-wlm (= slurmctld + slurmd + slurm-client) and munge. No systemd, no cgroups
# (proctrack/linuxproc, task/none), no accounting database. Ports: SLURMCTLD_PORT/SLURMD_PORT if set,
# else two free ports, so several clusters (e.g. concurrent test runs) can coexist on one host.
# The node gets CPUs = SLURM_CPUS (default: online CPUs, at least 2) and no GPUs (GRES) — a CPU test cluster.
# SLURM_NODES=N (default 1) emulates N nodes on this host: N slurmd daemons (slurmd -N nodeK) named
# node1..nodeN with NodeAddr 127.0.0.1 and their own ports, so multi-node sbatch scripts (srun one
# task per node, SLURM_NODEID, SLURM_JOB_NODELIST) really run. Node names do not resolve as host
# names; job scripts must fall back to `scontrol show node` NodeAddr (examples/slurm/common.sh does).
# Adapted from the tested recipe shared/recipes/slurm/local_slurm.sh (Debian bookworm, Slurm 22.05).
set -euo pipefail

die() { echo "local_slurm.sh: $*" >&2; exit 1; }

install_pkgs() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
     && command -v munged >/dev/null; then
    return 0
  fi
  [ "$(id -u)" = 0 ] || die "slurm-wlm/munge are not installed and installing them needs root"
  command -v apt-get >/dev/null || die "slurm-wlm/munge are not installed and apt-get is not available"
  echo "local_slurm.sh: installing slurm-wlm munge with apt-get" >&2
  apt-get update -qq >&2 || die "apt-get update failed (no network to the Debian archive?)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >&2 \
    || die "apt-get install slurm-wlm munge failed"
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

cmd=${1:-}
case "$cmd" in
  install) install_pkgs; exit 0 ;;
  start|stop) [ -n "${2:-}" ] || die "usage: $0 $cmd DIR" ;;
  *) die "usage: $0 {install|start DIR|stop DIR}" ;;
esac
D=$(realpath -m "$2")

if [ "$cmd" = stop ]; then
  for f in "$D"/run/slurmd*.pid "$D/run/slurmctld.pid" "$D/run/munged.pid"; do
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$f"
  done
  exit 0
fi

[ "$(id -u)" = 0 ] || die "must run as root (slurmd/munged as root, as in the recipe)"
install_pkgs
mkdir -p "$D"/{state,spool,log,munge,run}
if [ ! -f "$D/munge/munge.key" ]; then
  head -c 1024 /dev/urandom > "$D/munge/munge.key"
  chmod 400 "$D/munge/munge.key"
fi
munged --key-file="$D/munge/munge.key" --socket="$D/run/munge.sock" --pid-file="$D/run/munged.pid" \
       --log-file="$D/log/munged.log" --seed-file="$D/munge/seed" --force \
  || die "munged did not start (see $D/log/munged.log)"

H=$(hostname -s)
CTLD_PORT=${SLURMCTLD_PORT:-$(free_port)}
SLURMD_PORT=${SLURMD_PORT:-$(free_port)}
# CPUs per node: at least 2 (the CPU-mode jobs run 2 ranks per node). Not `nproc`: it follows
# OMP_NUM_THREADS. config_overrides makes slurmd trust this number instead of draining the node.
CPUS=${SLURM_CPUS:-$(getconf _NPROCESSORS_ONLN)}
[ "$CPUS" -ge 2 ] || CPUS=2
NODES=${SLURM_NODES:-1}
if [ "$NODES" -eq 1 ]; then
  NODE_LINES="NodeName=$H CPUs=$CPUS State=UNKNOWN"
  PART_NODES=$H
  NODE_NAMES=("")
else
  NODE_LINES=""
  NODE_NAMES=()
  for i in $(seq "$NODES"); do
    NODE_LINES+="NodeName=node$i NodeHostname=$H NodeAddr=127.0.0.1 Port=$(free_port) CPUs=$CPUS State=UNKNOWN"$'\n'
    NODE_NAMES+=("node$i")
  done
  PART_NODES="node[1-$NODES]"
fi
cat > "$D/slurm.conf" <<CONF
ClusterName=mtraining
SlurmctldHost=$H
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$D/run/munge.sock
CredType=cred/munge
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
SlurmdParameters=config_overrides
MpiDefault=none
KillWait=5
$NODE_LINES
PartitionName=debug Nodes=$PART_NODES Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
export SLURM_CONF="$D/slurm.conf"
slurmctld -f "$SLURM_CONF" || die "slurmctld did not start (see $D/log/slurmctld.log)"
for n in "${NODE_NAMES[@]}"; do
  if [ -z "$n" ]; then
    slurmd -f "$SLURM_CONF" || die "slurmd did not start (see $D/log/)"
  else
    slurmd -f "$SLURM_CONF" -N "$n" || die "slurmd -N $n did not start (see $D/log/)"
  fi
done
for _ in $(seq 60); do
  if [ "$(sinfo -h -N -o %t 2>/dev/null | grep -c idle)" -eq "$NODES" ]; then
    echo "export SLURM_CONF=$D/slurm.conf"
    exit 0
  fi
  sleep 1
done
echo "local_slurm.sh: $NODES node(s) did not become idle in 60 s; sinfo: $(sinfo -h -N 2>&1 | head -5)" >&2
tail -n 5 "$D"/log/*.log >&2 || true
exit 1
