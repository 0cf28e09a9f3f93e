#!/usr/bin/env bash
# A Slurm cluster on localhost for the tests: munge, slurmctld and slurmd, no accounting database
# (scontrol keeps finished jobs for MinJobAge, which is all the tests read). One node; SLURM_NODES=N
# starts N, each a slurmd of its own (`slurmd -N NAME`, its own port) on this host: multi-node jobs.
#
#   .ci/slurm.sh install          apt-get the Debian packages if missing (root; ~15 s)
#   .ci/slurm.sh start DIR        start a cluster whose state, logs and slurm.conf live in DIR;
#                                 prints `export SLURM_CONF=DIR/slurm.conf` (~3 s)
#   .ci/slurm.sh stop DIR         stop the daemons that `start DIR` started (by their pid files)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/daemons.sh"
USERS=/run/munge/layertap-clusters  # one empty file per running test cluster that uses munged
LOCK=/run/munge/layertap.lock
MUNGED_PID=/run/munge/layertap-munged.pid  # the munged a test cluster started (none: it was already running)

install() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null && return 0
  [ "$(id -u)" = 0 ] || { echo "installing Slurm needs root: apt-get install slurmctld slurmd slurm-client munge" >&2; exit 1; }
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null; }
}

start() {
  local S HOST CPUS MEM NODES NAMES SPOOL PIDS LOGS NODELINES
  S=$(realpath -m "$1"); HOST=$(hostname -s); NODES=${SLURM_NODES:-1}
  mkdir -p "$S"/{state,spool,log}
  # munge: the Debian package generated /etc/munge/munge.key; a daemon already running is reused.
  # Clusters of parallel test workers share it: each is on record under $USERS while it runs, and
  # the last to stop stops the daemon a cluster started (the first cluster's stop killed it under
  # the others: "Munge encode failed", sbatch refused). Under a lock, so a start and a stop never
  # interleave.
  mkdir -p /run/munge "$USERS" && chown munge:munge /run/munge
  (
    flock 9
    : > "$USERS/$(printf %s "$S" | md5sum | cut -c1-16)"
    if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
      # munged runs as munge, which cannot reach a 0700 folder such as pytest's: its pid file goes in /run/munge
      runuser -u munge -- /usr/sbin/munged --pid-file="$MUNGED_PID" 9>&-  # the daemon must not hold the lock
      for _ in $(seq 1 40); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    fi
  ) 9>"$LOCK"
  CPUS=$(nproc); MEM=$(( $(awk '/MemTotal/{print $2}' /proc/meminfo) / 1024 - 2048 ))
  # Ports of our own, so a cluster already on this host (or one a crashed run left) is no obstacle.
  read -r CTLD_PORT SLURMD_PORT PORTS < <(free_ports $((2 + NODES)))
  NAMES=$HOST; SPOOL=$S/spool; PIDS=$S/slurmd.pid; LOGS=$S/log/slurmd.log
  NODELINES="NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM State=UNKNOWN"
  if [ "$NODES" -gt 1 ]; then  # node i beside this host's name: HOSTn2, ...; none of them resolves but the first
    read -ra PORTS <<< "$PORTS"
    NAMES="$HOST $(seq -f "${HOST}n%g" 2 "$NODES" | tr '\n' ' ')"; SPOOL=$S/spool/%n; PIDS=$S/slurmd-%n.pid
    LOGS=$S/log/slurmd-%n.log; NODELINES=""; i=0
    for name in $NAMES; do
      NODELINES+="NodeName=$name NodeHostname=$HOST NodeAddr=127.0.0.1 Port=${PORTS[$i]} CPUs=$CPUS"
      NODELINES+=" RealMemory=$((MEM / NODES)) State=UNKNOWN"$'\n'; i=$((i + 1)); mkdir -p "$S/spool/$name"
    done
  fi
  cat > "$S/slurm.conf" <<EOF
ClusterName=layertapci
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$S/state
SlurmdSpoolDir=$SPOOL
SlurmctldPidFile=$S/slurmctld.pid
SlurmdPidFile=$PIDS
SlurmctldLogFile=$S/log/slurmctld.log
SlurmdLogFile=$LOGS
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=600
SchedulerParameters=defer_batch
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
$NODELINES
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF=$S/slurm.conf
  /usr/sbin/slurmctld
  if [ "$NODES" -gt 1 ]; then for name in $NAMES; do /usr/sbin/slurmd -N "$name"; done; else /usr/sbin/slurmd; fi
  for _ in $(seq 1 100); do [ "$(sinfo -h -o '%T %D' 2>/dev/null)" = "idle $NODES" ] && break; sleep 0.1; done
  [ "$(sinfo -h -o '%T %D')" = "idle $NODES" ] || { echo "slurm did not come up; logs in $S/log" >&2; exit 1; }
  echo "export SLURM_CONF=$SLURM_CONF"
}

stop() {
  local S
  S=$(realpath -m "$1")
  stop_pidfiles "$S"/slurmd*.pid "$S/slurmctld.pid"
  [ -d "$USERS" ] || return 0
  (
    flock 9
    rm -f "$USERS/$(printf %s "$S" | md5sum | cut -c1-16)"
    if [ -z "$(ls -A "$USERS")" ] && [ -f "$MUNGED_PID" ]; then
      stop_pidfiles "$MUNGED_PID" && rm -f "$MUNGED_PID"
    fi
  ) 9>"$LOCK"
}

dispatch "$@"
