#!/usr/bin/env bash
# setup_slurm.sh - a real one-node Slurm cluster on this machine, for the Slurm test tier
# (tests/slurm/) and for trying the sbatch scripts in slurm/ (Debian/Ubuntu, root, no systemd
# needed). Adapted from docs/SLURM_LOCAL.md, where every step is explained and timed.
# Usage: scripts/setup_slurm.sh start|stop|restart|status|reset
#   start   install slurm-wlm + munge with apt if missing, write /etc/slurm/slurm.conf,
#           start munged, slurmctld, slurmd (each only if not already running),
#           wait until the node is idle. Idempotent: ~0.1 s when all is running already.
#   stop    cancel all jobs, stop slurmd, slurmctld, munged (by their pid files).
#   reset   stop, wipe controller/node state (job ids restart at 1), start.
# Exit code 3 (with one line saying why) when Slurm cannot be installed here: not root, or no
# apt-get (the tests skip with that reason).
# Env: SLURM_LOCAL_NODE=name   node name (default: hostname -s; "localhost" works too)
#      SLURM_LOCAL_CGROUP=1    use proctrack/cgroup + task/cgroup (enforces --mem).
#      SLURM_LOCAL_KILLWAIT=s  seconds between SIGTERM and SIGKILL when a job is requeued,
#                              cancelled or times out (default 60: long enough for the tiny
#                              trainer to finish a step and write a checkpoint).
set -euo pipefail

NODE="${SLURM_LOCAL_NODE:-$(hostname -s)}"
if [ "${SLURM_LOCAL_CGROUP:-0}" = 1 ]; then
  PROCTRACK=proctrack/cgroup; TASK=task/cgroup
else
  PROCTRACK=proctrack/linuxproc; TASK=task/none
fi
CONF=/etc/slurm/slurm.conf
KILLWAIT="${SLURM_LOCAL_KILLWAIT:-60}"
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
MUNGE_PID=/run/munge/munged.pid
LOG=/var/log/slurm

log() { echo "[setup_slurm] $*" >&2; }

alive() { # alive PIDFILE -> 0 if the process in PIDFILE runs
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_pkgs() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
     && command -v munged >/dev/null && command -v sinfo >/dev/null; then
    return
  fi
  if [ "$(id -u)" != 0 ]; then
    echo "setup_slurm: cannot install slurm-wlm and munge: not root" >&2; exit 3
  fi
  if ! command -v apt-get >/dev/null; then
    echo "setup_slurm: cannot install slurm-wlm and munge: no apt-get on this machine" >&2; exit 3
  fi
  log "installing slurm-wlm and munge"
  export DEBIAN_FRONTEND=noninteractive
  if ! { apt-get -o DPkg::Lock::Timeout=600 update -qq && apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends slurm-wlm munge >/dev/null; }; then
    echo "setup_slurm: cannot install slurm-wlm and munge: apt-get failed (no package mirror?)" >&2; exit 3
  fi
}

write_conf() {
  local cpus mem tmp
  cpus=$(nproc)
  # RealMemory must not exceed what slurmd detects; leave ~10% for the OS.
  mem=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
  mem=$(( mem * 9 / 10 ))
  tmp=$(mktemp)
  cat >"$tmp" <<EOF
# written by scripts/setup_slurm.sh (megatron-rl test cluster)
ClusterName=local
SlurmctldHost=${NODE}(127.0.0.1)
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=${CTLD_PID}
SlurmdPidFile=${SLURMD_PID}
SlurmctldLogFile=${LOG}/slurmctld.log
SlurmdLogFile=${LOG}/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=${PROCTRACK}
TaskPlugin=${TASK}
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$(( mem / cpus ))
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=${KILLWAIT}
Waittime=0
NodeName=${NODE} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  if [ "$TASK" = task/cgroup ]; then
    printf 'CgroupPlugin=autodetect\nConstrainCores=yes\nConstrainRAMSpace=yes\n' >>"$tmp.cg"
  fi
  local changed=1
  if cmp -s "$tmp" "$CONF"; then changed=0; fi
  if [ -e "$tmp.cg" ]; then
    cmp -s "$tmp.cg" /etc/slurm/cgroup.conf || { install -m 644 "$tmp.cg" /etc/slurm/cgroup.conf; changed=1; }
  elif [ -e /etc/slurm/cgroup.conf ]; then
    rm -f /etc/slurm/cgroup.conf; changed=1
  fi
  [ "$changed" = 1 ] && install -m 644 "$tmp" "$CONF"
  rm -f "$tmp" "$tmp.cg"
  [ "$changed" = 1 ]   # status 0 = changed
}

prepare_dirs() {
  install -d -o munge -g munge -m 755 /run/munge
  install -d -o munge -g munge -m 700 /var/log/munge /etc/munge
  install -d -o munge -g munge -m 711 /var/lib/munge
  if [ ! -s /etc/munge/munge.key ]; then
    log "creating munge key"
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=128 status=none
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 600 /etc/munge/munge.key
  install -d -o slurm -g slurm -m 755 /var/spool/slurmctld "$LOG"
  install -d -o root -g root -m 755 /var/spool/slurmd
}

wait_idle() {
  local i st
  for i in $(seq 1 60); do
    st=$(sinfo -h -n "$NODE" -o %t 2>/dev/null || true)
    case "$st" in
      idle|mix|alloc) log "node $NODE is $st"; return 0 ;;
      drain*|down*)   scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 0.5
  done
  log "node $NODE did not become idle; last state '$st'"
  tail -n 20 "$LOG/slurmctld.log" "$LOG/slurmd.log" >&2 || true
  return 1
}

start() {
  install_pkgs
  prepare_dirs
  local changed=0
  if write_conf; then changed=1; fi
  if ! alive "$MUNGE_PID"; then
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged --force
  fi
  if [ "$changed" = 1 ] && { alive "$CTLD_PID" || alive "$SLURMD_PID"; }; then
    log "slurm.conf changed: restarting daemons"
    stop_daemons
  fi
  if ! alive "$CTLD_PID"; then
    log "starting slurmctld"
    slurmctld            # daemonizes, drops to SlurmUser=slurm
    for _ in $(seq 1 40); do scontrol ping >/dev/null 2>&1 && break; sleep 0.25; done
  fi
  if ! alive "$SLURMD_PID"; then
    log "starting slurmd"
    slurmd -N "$NODE"    # daemonizes
  fi
  wait_idle
}

stop_one() { # stop_one PIDFILE NAME
  if alive "$1"; then
    local pid; pid=$(cat "$1")
    log "stopping $2 ($pid)"
    kill -TERM "$pid"
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" || true
  fi
  rm -f "$1"
}

stop_daemons() {
  stop_one "$SLURMD_PID" slurmd
  stop_one "$CTLD_PID" slurmctld
}

stop() {
  if alive "$CTLD_PID"; then
    local jobs; jobs=$(squeue -h -o %i 2>/dev/null || true)
    if [ -n "$jobs" ]; then log "cancelling jobs: $(echo $jobs)"; scancel $jobs || true; sleep 1; fi
  fi
  stop_daemons
  stop_one "$MUNGE_PID" munged
}

case "${1:-}" in
  start)   start ;;
  stop)    stop ;;
  restart) stop; start ;;
  reset)   stop; rm -rf /var/spool/slurmctld/* /var/spool/slurmd/*; start ;;
  status)  sinfo; squeue ;;
  *) echo "usage: $0 start|stop|restart|status|reset" >&2; exit 2 ;;
esac
