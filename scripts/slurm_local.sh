#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, to try the sbatch scripts and to test them (tests/slurm_cluster.py):
#
#   scripts/slurm_local.sh up       # install slurm-wlm + munge where missing, start munged, slurmctld, slurmd
#   export SLURM_CONF=/tmp/satlab-slurm/slurm.conf     # `up` prints this line; sinfo, sbatch, ... read it
#   scripts/slurm_local.sh status   # the daemons' PIDs and `sinfo`
#   scripts/slurm_local.sh down     # cancel the jobs left, stop the daemons by PID (the folder and logs stay)
#
# Everything lives in one folder, SLURM_LOCAL_DIR (default /tmp/satlab-slurm): slurm.conf, the state and spool
# folders, PID files and logs, and a private munge key and socket when the system's munged is not running. The
# node declares this machine's real CPUs and memory (`slurmd -C`); one partition, `debug`; jobs may requeue; the
# daemons listen on free ports and run as root, so `up` needs root (the common CI recipe for SLURM tools:
# proctrack/linuxproc, no cgroups). Running `up` twice leaves the running cluster as it is; so does `down` twice.
# SLURM_LOCAL_CRED_EXPIRE (default 10 s) is how long a requeued job waits before it may start again (120 s on a
# stock cluster). Exit codes: 0 done, 1 a daemon did not come up (its log is printed), 3 SLURM cannot be installed.
set -euo pipefail

DIR="${SLURM_LOCAL_DIR:-${TMPDIR:-/tmp}/satlab-slurm}"
CONF="$DIR/slurm.conf"
CRED_EXPIRE="${SLURM_LOCAL_CRED_EXPIRE:-10}"
export SLURM_CONF="$CONF"

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

install() {
  local missing=()
  command -v slurmctld >/dev/null || missing+=(slurmctld)
  command -v slurmd >/dev/null || missing+=(slurmd)
  command -v sbatch >/dev/null || missing+=(slurm-client)
  command -v munged >/dev/null || missing+=(munge)
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "slurm_local: SLURM is not installed (${missing[*]} missing) and cannot be installed here: it needs root" \
         "and apt-get (Debian/Ubuntu: apt-get install slurm-wlm munge)" >&2
    exit 3
  fi
  echo "slurm_local: installing slurm-wlm and munge (apt-get)"
  if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >"$DIR/apt.log" 2>&1 ||
         { apt-get update -q >>"$DIR/apt.log" 2>&1 &&
           DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >>"$DIR/apt.log" 2>&1; }; }; then
    tail -5 "$DIR/apt.log" >&2
    echo "slurm_local: apt-get could not install slurm-wlm and munge (log: $DIR/apt.log)" >&2
    exit 3
  fi
}

start_munge() {
  # The system's munged, where it runs; otherwise a private one with its own key and socket.
  if [ -S /run/munge/munge.socket.2 ] && munge -n -S /run/munge/munge.socket.2 </dev/null >/dev/null 2>&1; then
    echo /run/munge/munge.socket.2
    return
  fi
  local socket="$DIR/munge/munge.socket"
  if ! alive "$DIR/munge/munged.pid"; then
    mkdir -p "$DIR/munge"
    chmod 0700 "$DIR/munge"
    [ -s "$DIR/munge/munge.key" ] || { head -c 1024 /dev/urandom >"$DIR/munge/munge.key"; chmod 0400 "$DIR/munge/munge.key"; }
    munged --force --key-file="$DIR/munge/munge.key" --socket="$socket" --pid-file="$DIR/munge/munged.pid" \
      --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" >&2
  fi
  echo "$socket"
}

write_conf() {
  local socket=$1 node memory
  node=$(slurmd -C | head -1)   # NodeName=<host> CPUs=.. Boards=.. SocketsPerBoard=.. ... RealMemory=..
  memory=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node")
  node=$(sed "s/RealMemory=[0-9]*/RealMemory=$((memory * 95 / 100))/" <<<"$node")   # slurmd drains a node
  mkdir -p "$DIR/ctld" "$DIR/spool"                                                # that has less than declared
  cat >"$CONF" <<EOF
# Written by scripts/slurm_local.sh: a one-node cluster for trying and testing satlab's sbatch scripts.
ClusterName=satlab
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$socket,cred_expire=$CRED_EXPIRE
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobRequeue=1
ReturnToService=2
KillWait=10
MinJobAge=600
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.log
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

node_idle() { sinfo -h -N -o '%t' 2>/dev/null | grep -qx 'idle\|mix\|alloc'; }

up() {
  mkdir -p "$DIR"
  install
  if alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid" && node_idle; then
    echo "slurm_local: already up in $DIR"
    echo "export SLURM_CONF=$CONF"
    return 0
  fi
  local socket
  socket=$(start_munge)
  [ -s "$CONF" ] && ! alive "$DIR/slurmctld.pid" && ! alive "$DIR/slurmd.pid" && rm "$CONF"   # fresh ports
  [ -s "$CONF" ] || write_conf "$socket"
  alive "$DIR/slurmctld.pid" || slurmctld -f "$CONF"
  alive "$DIR/slurmd.pid" || slurmd -f "$CONF"
  for _ in $(seq 120); do
    if node_idle; then
      echo "slurm_local: up in $DIR"
      sinfo
      echo "export SLURM_CONF=$CONF"
      return 0
    fi
    sleep 0.5
  done
  echo "slurm_local: the node did not become idle within 60 s" >&2
  sinfo -N -l >&2 || true
  tail -20 "$DIR/slurmctld.log" "$DIR/slurmd.log" >&2 || true
  exit 1
}

stop() {  # stop <pidfile>: SIGTERM, then SIGKILL after 15 s
  local pid
  alive "$1" || return 0
  pid=$(cat "$1")
  kill -TERM "$pid"
  for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
}

down() {
  if alive "$DIR/slurmctld.pid"; then   # the jobs first, while slurmd can still end their processes
    mapfile -t jobs < <(squeue -h -o '%A' 2>/dev/null || true)
    if [ ${#jobs[@]} -gt 0 ]; then
      scancel "${jobs[@]}" 2>/dev/null || true
      for _ in $(seq 60); do [ -z "$(squeue -h -o '%A' 2>/dev/null)" ] && break; sleep 0.5; done
    fi
  fi
  stop "$DIR/slurmd.pid"
  stop "$DIR/slurmctld.pid"
  stop "$DIR/munge/munged.pid"
  echo "slurm_local: down ($DIR kept: logs and state)"
}

status() {
  local name
  for name in slurmctld slurmd munge/munged; do
    if alive "$DIR/$name.pid"; then echo "$name: running, PID $(cat "$DIR/$name.pid")"; else echo "$name: stopped"; fi
  done
  if alive "$DIR/slurmctld.pid"; then sinfo; echo "export SLURM_CONF=$CONF"; else return 1; fi
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: scripts/slurm_local.sh up|down|status   (SLURM_LOCAL_DIR=$DIR)" >&2; exit 2 ;;
esac
