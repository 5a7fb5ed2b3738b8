#!/usr/bin/env bash
# A real Slurm with two nodes on this machine (node1 and node2, both on the loopback), for
# tests and for learning: jobs can span nodes (`--nodes=2`), so rank placement,
# MASTER_ADDR and process groups that cross a node boundary are exercised.
#
#   sudo slurm/setup_local_slurm.sh        # idempotent: safe to run again
#   sinfo; srun -n 2 hostname; sbatch slurm/verify.sbatch
#   sudo slurm/setup_local_slurm.sh --stop # stop the daemons it started
#
# What it does (as root, no systemd needed, works inside a container):
#   1. installs Debian/Ubuntu's slurm-wlm + munge (apt-get) when they are missing;
#   2. writes a minimal slurm.conf for two nodes, node1 and node2 (partition `debug`);
#   3. creates a munge key when there is none;
#   4. starts munged, slurmctld and one slurmd per node as plain daemons (no systemd);
#   5. waits until `sinfo` shows both nodes idle.
#
# The cluster is a test cluster. Things to know:
#   * Two slurmd run on this one host: each is started with `-N nodeN`, listens on its
#     own port (6818, 6819) and keeps its own spool, pid and log file (%n in slurm.conf).
#     Both nodes have NodeAddr=127.0.0.1, so a two-node job's ranks reach each other over
#     the loopback exactly as they would over a cluster network.
#   * Each node declares CPUs=max(nproc, $MINITRON_SLURM_CPUS) (default 16) with
#     `SlurmdParameters=config_overrides`, so an 8-task job fits on a 2-core laptop:
#     Slurm hands out "CPUs" it does not have and the tasks share the real cores
#     (oversubscription, fine for gloo tests, never for real training). The partition
#     also has OverSubscribe=YES, so jobs submitted with --oversubscribe may share CPUs.
#   * No cgroups: ProctrackType=proctrack/linuxproc, TaskPlugin=task/none,
#     JobAcctGatherType=jobacct_gather/none; no accounting database; MpiDefault=none.
#   * Daemons run as root (SlurmUser=root); state lives in /var/spool/slurm-minitron,
#     logs in /var/log/slurm-minitron/{slurmctld,slurmd-node1,slurmd-node2}.log.
#   * MinJobAge=4: `sbatch --wait` then polls every 2 s (with the default 300 it sleeps
#     2, 8, 32 s between polls, so a 10-second job returns after 42 s). Finished jobs
#     stay visible (scontrol show job) until the next purge, about a minute.
#   * An existing slurm.conf that this script did not write is never overwritten
#     (set MINITRON_SLURM_FORCE=1 to overwrite it anyway).
set -euo pipefail

CONF_DIR=${SLURM_CONF_DIR:-/etc/slurm}
CONF=$CONF_DIR/slurm.conf
STATE=/var/spool/slurm-minitron
LOGS=/var/log/slurm-minitron
MARK="# written by minitron slurm/setup_local_slurm.sh"
WANT_CPUS=${MINITRON_SLURM_CPUS:-16}

say() { echo "setup_local_slurm: $*"; }
die() { echo "setup_local_slurm: error: $*" >&2; exit 1; }

pid_alive() {  # pid_alive PIDFILE NAME -> 0 when the pidfile names a live NAME process
  local f=$1 name=$2 pid
  [[ -s $f ]] || return 1
  pid=$(cat "$f" 2>/dev/null) || return 1
  [[ -n $pid && -r /proc/$pid/comm ]] || return 1
  [[ $(cat "/proc/$pid/comm") == "$name" ]]
}

stop_daemon() {  # stop_daemon PIDFILE NAME
  local f=$1 name=$2
  if pid_alive "$f" "$name"; then
    local pid; pid=$(cat "$f")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do [[ -d /proc/$pid ]] || break; sleep 0.1; done
    say "stopped $name ($pid)"
  fi
  rm -f "$f"
}

NODES=(node1 node2)

if [[ ${1:-} == --stop ]]; then
  for n in "${NODES[@]}"; do stop_daemon "/run/slurm-minitron/slurmd-$n.pid" slurmd; done
  stop_daemon /run/slurm-minitron/slurmd.pid slurmd  # a single-node setup of an older version
  stop_daemon /run/slurm-minitron/slurmctld.pid slurmctld
  stop_daemon /run/munge/munged.pid munged
  exit 0
fi

[[ $(id -u) == 0 ]] || die "run as root (it installs packages and starts daemons): sudo $0"

# --- 1. packages ------------------------------------------------------------------------
need=()
command -v slurmctld >/dev/null || need+=(slurmctld)
command -v slurmd >/dev/null || need+=(slurmd)
command -v sinfo >/dev/null || need+=(slurm-client)
command -v munged >/dev/null || need+=(munge)
if ((${#need[@]})); then
  command -v apt-get >/dev/null || die "no apt-get: install ${need[*]} with your package manager"
  say "installing slurm-wlm munge (missing: ${need[*]})"
  export DEBIAN_FRONTEND=noninteractive
  # Keep the packages' maintainer scripts from starting services (no systemd here).
  policy_made=0
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; policy_made=1
  fi
  apt-get update -qq || apt-get update
  apt-get install -y -qq --no-install-recommends slurm-wlm slurm-client munge >/dev/null \
    || apt-get install -y --no-install-recommends slurm-wlm slurm-client munge
  ((policy_made)) && rm -f /usr/sbin/policy-rc.d
fi

# --- 2. slurm.conf -------------------------------------------------------------------------
ncpu=$(nproc)
cpus=$(( ncpu > WANT_CPUS ? ncpu : WANT_CPUS ))
mem_mb=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
mkdir -p "$CONF_DIR" "$STATE/ctld" "$STATE/d" "$LOGS" /run/slurm-minitron
conf=$(cat <<EOF
$MARK
# A two-node test cluster on one host: see the header of that script. Not for production.
ClusterName=minitron
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
SlurmdParameters=config_overrides
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d-%n
SlurmctldPidFile=/run/slurm-minitron/slurmctld.pid
SlurmdPidFile=/run/slurm-minitron/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
MinJobAge=4
Waittime=0
MailProg=/bin/true
NodeName=node1 NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=6818 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
NodeName=node2 NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=6819 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
)
changed=0
if [[ -e $CONF ]] && ! grep -qF "$MARK" "$CONF" && [[ ${MINITRON_SLURM_FORCE:-0} != 1 ]]; then
  die "$CONF exists and was not written by this script; set MINITRON_SLURM_FORCE=1 to replace it"
fi
if [[ ! -e $CONF ]] || [[ $(cat "$CONF") != "$conf" ]]; then
  printf '%s\n' "$conf" >"$CONF"
  changed=1
  say "wrote $CONF (nodes node1 and node2, CPUs=$cpus each on $ncpu cores, RealMemory=${mem_mb}M)"
fi
# slurmd looks for cgroup.conf only with cgroup plugins; none are configured here.

# --- 3. munge ------------------------------------------------------------------------------
id munge >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin munge
mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
  if command -v mungekey >/dev/null; then
    mungekey --create --keyfile=/etc/munge/munge.key --force
  else
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  fi
  say "created /etc/munge/munge.key"
fi
chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
chmod 0700 /etc/munge /var/lib/munge /var/log/munge
chmod 0755 /run/munge
chmod 0400 /etc/munge/munge.key
if ! pid_alive /run/munge/munged.pid munged; then
  rm -f /run/munge/munged.pid /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
  runuser -u munge -- /usr/sbin/munged --force
  say "started munged"
fi
for _ in $(seq 50); do munge -n </dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
munge -n </dev/null | unmunge >/dev/null || die "munge does not work: see /var/log/munge/munged.log"

# The node names must resolve, as a cluster's do (its DNS or /etc/hosts): rank 0's node is
# MASTER_ADDR. Both are this host, on the loopback.
for n in "${NODES[@]}"; do
  getent hosts "$n" >/dev/null || echo "127.0.0.1 $n  $MARK" >>/etc/hosts
done

# --- 4. slurmctld and slurmd ---------------------------------------------------------------
if ((changed)); then  # a new configuration: restart what runs
  for n in "${NODES[@]}"; do stop_daemon "/run/slurm-minitron/slurmd-$n.pid" slurmd; done
  stop_daemon /run/slurm-minitron/slurmd.pid slurmd
  stop_daemon /run/slurm-minitron/slurmctld.pid slurmctld
fi
if ! pid_alive /run/slurm-minitron/slurmctld.pid slurmctld; then
  slurmctld -f "$CONF" || die "slurmctld did not start: see $LOGS/slurmctld.log"
  say "started slurmctld"
fi
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
scontrol ping | grep -q UP || die "slurmctld does not answer: see $LOGS/slurmctld.log"
for n in "${NODES[@]}"; do
  mkdir -p "$STATE/d-$n"
  if ! pid_alive "/run/slurm-minitron/slurmd-$n.pid" slurmd; then
    slurmd -f "$CONF" -N "$n" || die "slurmd for $n did not start: see $LOGS/slurmd-$n.log"
    say "started slurmd for $n"
  fi
done

# --- 5. wait for the nodes ------------------------------------------------------------------
for n in "${NODES[@]}"; do
  state=""
  for _ in $(seq 150); do
    state=$(sinfo -h -n "$n" -o %T 2>/dev/null | head -1)
    case $state in
      idle|mixed|allocated) break ;;
      down*|drain*|fail*) scontrol update NodeName="$n" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 0.2
  done
  case $state in
    idle|mixed|allocated) ;;
    *) sinfo -R >&2 || true; die "node $n is '$state', not idle: see $LOGS/slurmd-$n.log and $LOGS/slurmctld.log" ;;
  esac
done
sinfo
say "ready: try 'srun -N 2 -n 4 hostname'"
