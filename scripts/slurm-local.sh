#!/usr/bin/env bash
# Start (or stop) a real single-node Slurm on this machine, for the tests.
#
#   bash scripts/slurm-local.sh start   # install slurm-wlm + munge if needed, configure, start
#   bash scripts/slurm-local.sh stop
#
# The node claims 8 CPUs whatever it has (SlurmdParameters=config_overrides), so
# a 4-task job fits on a 2-core test machine; never use this config on a cluster.
set -euo pipefail
action=${1:-start}
conf=/etc/slurm/slurm.conf
node=$(hostname -s)

if [ "$action" = stop ]; then
  pkill -x slurmd || true; pkill -x slurmctld || true
  exit 0
fi

sudo=""; [ "$(id -u)" -ne 0 ] && sudo=sudo
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends \
    slurm-wlm munge >/dev/null
fi
$sudo mkdir -p /etc/munge /run/munge /var/spool/mpishard-slurmctld /var/spool/mpishard-slurmd /var/log/slurm
if [ ! -s /etc/munge/munge.key ]; then
  $sudo dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
$sudo chown munge:munge /etc/munge/munge.key /run/munge
$sudo chmod 400 /etc/munge/munge.key
pgrep -x munged >/dev/null || $sudo runuser -u munge -- /usr/sbin/munged --force

mem=$(awk '/MemTotal/{print int($2 / 1024 * 0.8)}' /proc/meminfo)
$sudo tee "$conf" >/dev/null <<EOC
# Written by mpishard's scripts/slurm-local.sh: a single-node test cluster.
ClusterName=mpishard-test
SlurmctldHost=$node
SlurmUser=root
AuthType=auth/munge
# A requeued job waits for its old credential to expire (default 120 s): the
# tests requeue jobs, so keep that short on this test cluster.
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
StateSaveLocation=/var/spool/mpishard-slurmctld
SlurmdSpoolDir=/var/spool/mpishard-slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ReturnToService=2
MpiDefault=pmix
JobAcctGatherType=jobacct_gather/none
NodeName=$node CPUs=8 RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOC
pkill -x slurmd || true; pkill -x slurmctld || true
sleep 1
# A test cluster starts from empty state every time (its own spool folders).
$sudo rm -rf /var/spool/mpishard-slurmctld/* /var/spool/mpishard-slurmd/*
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
