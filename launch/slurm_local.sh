#!/usr/bin/env bash
# A single-node Slurm cluster on this machine, to try launch/slurm.sbatch under a real Slurm (Debian's slurm-wlm,
# 22.05 on bookworm). Run as root; not needed by `make test` (tests/launch/test_slurm.py uses a fake Slurm).
#   launch/slurm_local.sh start [cgroup|linuxproc]   install slurm-wlm if missing, write the config, start the daemons
#   launch/slurm_local.sh stop                       stop slurmctld, slurmd and munged
#   launch/slurm_local.sh status                     sinfo and squeue
# Then, from the repository root (the node has 2 CPUs and no GPU):
#   sbatch --nodes=1 --gpus-per-node=0 --cpus-per-task=2 --time=5 launch/slurm.sbatch \
#     model=v41_tiny trainer.num_threads=1 trainer.max_steps=50
# `start` again with the other ProctrackType restarts the daemons with it (no job may be running).
set -euo pipefail

PROCTRACK=${2:-cgroup}
NODE=$(hostname -s)
CPUS=${SLURM_LOCAL_CPUS:-2}

start() {
  [[ $PROCTRACK == cgroup || $PROCTRACK == linuxproc ]] || { echo "usage: $0 start [cgroup|linuxproc]" >&2; exit 2; }
  [[ $(id -u) == 0 ]] || { echo "$0: run as root (the daemons and munge need it)" >&2; exit 2; }
  if ! command -v slurmctld >/dev/null; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm
  fi
  stop quiet
  mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
  # munge: the package made a key; make one if it is missing. munged runs as its own user.
  if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key /run/munge && chmod 400 /etc/munge/munge.key
  runuser -u munge -- /usr/sbin/munged
  cat > /etc/slurm/slurm.conf <<EOF
ClusterName=cedar-local
SlurmctldHost=${NODE}
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/${PROCTRACK}
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
# seconds between a job's SIGTERM (scancel, time limit) and its SIGKILL: the ranks' save must fit
KillWait=60
MinJobAge=600
NodeName=${NODE} CPUs=${CPUS} State=UNKNOWN
PartitionName=local Nodes=${NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  # This machine mounts cgroup v1 controllers (and a v2 hierarchy under unified/): proctrack/cgroup uses freezer.
  cat > /etc/slurm/cgroup.conf <<EOF
CgroupPlugin=autodetect
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF
  slurmctld -i
  slurmd
  for _ in $(seq 30); do
    sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)' && break
    sleep 1
  done
  scontrol update nodename="$NODE" state=resume 2>/dev/null || true
  sinfo
  scontrol show config | grep -E '^(ProctrackType|KillWait|SLURM_VERSION)'
}

# The pid in file $1, if that process runs.
pid_of() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null && cat "$1"; }

stop() {
  local pid f
  for f in /run/slurmd.pid /run/slurmctld.pid /run/munge/munged.pid; do
    if pid=$(pid_of "$f"); then
      kill -TERM "$pid"
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    fi
  done
  [[ ${1:-} == quiet ]] || echo "slurmd, slurmctld and munged stopped"
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  status) sinfo; squeue ;;
  *) echo "usage: $0 start [cgroup|linuxproc] | stop | status" >&2; exit 2 ;;
esac
