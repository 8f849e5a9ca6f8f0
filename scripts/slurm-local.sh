#!/usr/bin/env bash
# Start (or stop) a real Slurm on this machine, for the tests: one node, or one
# slurmd per node of the namespace cluster of scripts/cluster-local.sh.
#
#   bash scripts/slurm-local.sh start             # install slurm-wlm + munge if needed, configure, start
#   bash scripts/slurm-local.sh stop
#
#   bash scripts/cluster-local.sh start --nodes 2 # the nodes (network namespaces)
#   bash scripts/slurm-local.sh start --cluster   # slurmctld on node 0, a slurmd in every node
#   bash scripts/cluster-local.sh exec sbatch -N 2 slurm/ddp.sbatch
#   bash scripts/slurm-local.sh stop --cluster    # (cluster-local.sh stop also ends them)
#
# One node: /etc/slurm/slurm.conf, the daemons in this machine's namespaces. The
# node claims 8 CPUs whatever it has (SlurmdParameters=config_overrides), so a
# 4-task job fits on a 2-core test machine; never use this config on a cluster.
#
# --cluster: everything under the cluster's state folder ($MPISHARD_CLUSTER_DIR,
# default /run/mpishard-cluster/slurm: slurm.conf, spool, logs, pid files), so it
# sits beside a one-node Slurm without touching it. The controller runs in node 0
# (the nodes' subnet exists only inside the namespaces), every node's slurmd in
# its namespace under its host name (slurmd -N), each node claiming as many CPUs
# as the cluster's slots. Slurm's commands must run inside a node:
# `cluster-local.sh exec CMD` (node 0) sets SLURM_CONF to this configuration.
# Jobs across nodes: srun --mpi=pmix starts the ranks, Open MPI's TCP transport
# carries what goes between nodes. munged is shared (a Unix socket on the file system).
#
# Daemons are stopped by the process ids in their pid files, never by name.
set -euo pipefail
action=${1:-start}
mode=${2:-}
[ -z "$mode" ] || [ "$mode" = --cluster ] || { echo "usage: $0 start|stop [--cluster]" >&2; exit 2; }
SCRIPTS=$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")
CLUSTER=$SCRIPTS/cluster-local.sh
STATE=${MPISHARD_CLUSTER_DIR:-/run/mpishard-cluster}
sudo=""; [ "$(id -u)" -ne 0 ] && sudo=sudo

if [ "$mode" = --cluster ]; then
  dir=$STATE/slurm
  conf=$dir/slurm.conf
  ctld_pid=$dir/slurmctld.pid
  d_pids=("$dir"/slurmd-*.pid)
else
  conf=/etc/slurm/slurm.conf
  ctld_pid=/run/slurmctld.pid   # Debian's defaults, written in the configuration below
  d_pids=(/run/slurmd.pid)
fi

# Ends the daemon whose id a pid file holds, if it is that daemon; waits for it.
kill_pidfile() {
  local file=$1 name=$2 pid
  [ -s "$file" ] || return 0
  pid=$(cat "$file")
  if [[ $pid =~ ^[0-9]+$ ]] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ]; then
    $sudo kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do [ -d "/proc/$pid" ] || break; sleep 0.1; done
    $sudo kill -9 "$pid" 2>/dev/null || true
  fi
  $sudo rm -f "$file"
}

stop_daemons() {
  local f
  for f in "${d_pids[@]}"; do [ -e "$f" ] && kill_pidfile "$f" slurmd; done
  kill_pidfile "$ctld_pid" slurmctld
}

if [ "$action" = stop ]; then
  stop_daemons
  [ "$mode" != --cluster ] || $sudo rm -rf "$dir"
  echo "[slurm-local] stopped"
  exit 0
fi
[ "$action" = start ] || { echo "usage: $0 start|stop [--cluster]" >&2; exit 2; }

if [ "$mode" = --cluster ] && [ "$(id -u)" -ne 0 ]; then
  echo "[slurm-local] --cluster needs root (it enters the cluster's network namespaces)" >&2
  exit 1
fi
if [ "$mode" = --cluster ] && ! [ -f "$STATE/config" ]; then
  echo "[slurm-local] no namespace cluster is up: bash $CLUSTER start --nodes 2 first" >&2
  exit 1
fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends \
    slurm-wlm munge >/dev/null
fi
$sudo mkdir -p /etc/munge /run/munge /etc/slurm /var/log/slurm
if [ ! -s /etc/munge/munge.key ]; then
  $sudo dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
$sudo chown munge:munge /etc/munge/munge.key /run/munge
$sudo chmod 400 /etc/munge/munge.key
pgrep -x munged >/dev/null || $sudo runuser -u munge -- /usr/sbin/munged --force

mem=$(awk '/MemTotal/{print int($2 / 1024 * 0.8)}' /proc/meminfo)

# The settings both kinds share.
common() {
  cat <<EOC
SlurmUser=root
AuthType=auth/munge
# A requeued job waits for its old credential to expire (default 120 s): the
# tests requeue jobs, so keep that short on this test cluster.
AuthInfo=cred_expire=10
# A job that can start only at a later pass of the scheduler (a requeued job, once its
# credential expired; one submitted while the last one completes) waited for it:
# every 60 s (main loop) or 30 s (backfill) by default: the requeued job of
# tests/jobs/test_slurm.py started again 20 and 29 s after its requeue, of which its
# credential's 10 s. Every 2 s on this test cluster.
SchedulerParameters=sched_interval=2,bf_interval=2
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=pmix
JobAcctGatherType=jobacct_gather/none
EOC
}

if [ "$mode" != --cluster ]; then
  node=$(hostname -s)
  spool=(/var/spool/mpishard-slurmctld /var/spool/mpishard-slurmd)
  $sudo mkdir -p "${spool[@]}"
  {
    echo "# Written by mpishard's scripts/slurm-local.sh: a single-node test cluster."
    echo "ClusterName=mpishard-test"
    echo "SlurmctldHost=$node"
    common
    cat <<EOC
StateSaveLocation=${spool[0]}
SlurmdSpoolDir=${spool[1]}
SlurmctldPidFile=$ctld_pid
SlurmdPidFile=${d_pids[0]}
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$node CPUs=8 RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOC
  } | $sudo tee "$conf" >/dev/null
  stop_daemons
  # A test cluster starts from empty state every time (its own spool folders).
  $sudo rm -rf "${spool[0]:?}"/* "${spool[1]:?}"/*
  $sudo slurmctld
  $sudo slurmd
  for _ in $(seq 30); do
    scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true
    if sinfo -h -N -o "%t" 2>/dev/null | grep -q "^idle"; then
      echo "[slurm-local] up: $(sinfo -h -N -o '%N %c CPUs %t')"
      exit 0
    fi
    sleep 1
  done
  echo "[slurm-local] slurmd did not come up; see /var/log/slurm/" >&2
  exit 1
fi

# --cluster: the nodes, their addresses and slots from the cluster's hostfile.
mapfile -t hosts < <(awk '{print $1}' "$STATE/hostfile")
slots=$(awk -F'slots=' 'NR == 1 {print $2 + 0}' "$STATE/hostfile")
nodes=${#hosts[@]}
addr() { awk -v h="$1" '$2 == h {print $1}' "/etc/netns/mpishard-n0/hosts"; }
stop_daemons
$sudo rm -rf "$dir"
mkdir -p "$dir/ctld"
{
  echo "# Written by mpishard's scripts/slurm-local.sh --cluster: one slurmd per namespace node."
  echo "ClusterName=mpishard-nodes"
  echo "SlurmctldHost=${hosts[0]}($(addr "${hosts[0]}"))"
  common
  cat <<EOC
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/spool-%n
SlurmctldPidFile=$ctld_pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
# Each node's own temporary folder: srun --mpi=pmix makes its clients' folder
# there (spmix_appdir_<uid>_<job>.<step>), which would collide in one shared /tmp.
TmpFS=$dir/tmp-%n
EOC
  for h in "${hosts[@]}"; do
    echo "NodeName=$h NodeAddr=$(addr "$h") CPUs=$slots RealMemory=$((mem / nodes)) State=UNKNOWN"
  done
  echo "PartitionName=nodes Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
} >"$conf"
for ((i = 0; i < nodes; i++)); do mkdir -p "$dir/spool-${hosts[$i]}" "$dir/tmp-${hosts[$i]}"; done
# Runs CMD in node I: its network namespace, its host name and hosts file. Not
# `ip netns exec`, which remounts /sys without /sys/fs/cgroup, where slurmd's
# cgroup plugin fails ("No filesystem mounted on /sys/fs/cgroup"); the daemons'
# mount namespace is private, so the hosts file's bind mount stays in it.
in_node() {
  local i=$1; shift
  SLURM_CONF=$conf nsenter --net="/run/netns/mpishard-n$i" unshare --mount --uts /bin/sh -c \
    'hosts=$0 host=$1; shift; mount --bind "$hosts" /etc/hosts && hostname "$host" && exec "$@"' \
    "/etc/netns/mpishard-n$i/hosts" "${hosts[$i]}" "$@"
}
failed() {   # the daemon's last log line says why; the others are stopped
  echo "[slurm-local] $1 did not start in ${hosts[$2]}: $(tail -n 1 "$3" 2>/dev/null)" >&2
  d_pids=("$dir"/slurmd-*.pid); stop_daemons
  exit 1
}
in_node 0 slurmctld || failed slurmctld 0 "$dir/slurmctld.log"
for ((i = 0; i < nodes; i++)); do
  in_node "$i" slurmd -N "${hosts[$i]}" || failed slurmd "$i" "$dir/slurmd-${hosts[$i]}.log"
done
for _ in $(seq 60); do
  idle=$(bash "$CLUSTER" exec sinfo -h -N -o "%t" 2>/dev/null | grep -c "^idle" || true)
  if [ "$idle" -eq "$nodes" ]; then
    echo "[slurm-local] up: $nodes nodes x $slots CPUs ($(bash "$CLUSTER" exec sinfo -h -o '%N'))," \
      "controller on ${hosts[0]}"
    echo "[slurm-local] configuration $conf; submit inside a node: bash $CLUSTER exec sbatch ..."
    exit 0
  fi
  sleep 1
done
echo "[slurm-local] the cluster's slurmd did not all come up; see $dir/*.log" >&2
bash "$CLUSTER" exec sinfo -N >&2 || true
d_pids=("$dir"/slurmd-*.pid); stop_daemons
exit 1
