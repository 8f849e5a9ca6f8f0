#!/usr/bin/env bash
# A multi-node Open MPI cluster on one machine: N Linux network namespaces ("nodes").
#
#   bash scripts/cluster-local.sh start --nodes 2 [--link-gbit 1]   # idempotent
#   bash scripts/cluster-local.sh status
#   bash scripts/cluster-local.sh stop                              # idempotent
#   bash scripts/cluster-local.sh exec CMD...   # run CMD on node 0 (mpirun goes here)
#   bash scripts/cluster-local.sh on I CMD...   # run CMD on node I
#   bash scripts/cluster-local.sh down I        # node I fails: its processes killed,
#   bash scripts/cluster-local.sh up I          #   unreachable until `up I`
#
# Layout (root only; nothing is added to the root namespace's network or /etc/hosts):
#
#   namespace mpishard-sw   a bridge "br0" (the switch), no address
#   namespace mpishard-n<i> "eth0" = 10.213.0.<i+1>/24, a veth pair to the switch;
#                           hostname mpishard-node<i> (its own UTS namespace, set by
#                           the rsh agent), names of all nodes in /etc/netns/<ns>/hosts
#                           (ip netns exec bind-mounts it over /etc/hosts)
#
# The 10.213.0.0/24 subnet exists only inside these namespaces, so traffic between
# nodes can only cross the veth links, where --link-gbit puts a tbf qdisc on both
# ends (each node's link capped in each direction). mpirun runs on node 0 (`exec`),
# and reaches the other nodes through an rsh agent that enters their namespace;
# Open MPI's TCP transport (btl tcp) carries what goes between nodes, shared memory
# (vader) what stays inside one.
#
# `start` writes $STATE/env (default STATE=/run/mpishard-cluster):
#   MPISHARD_CLUSTER_HOSTFILE      the hostfile (N nodes, --slots slots each)
#   MPISHARD_CLUSTER_MPIRUN_FLAGS  the flags mpirun needs (agent, subnet, transports)
#   MPISHARD_CLUSTER_EXEC          the command prefix that runs on node 0
# so a job is:
#   source /run/mpishard-cluster/env; source scripts/mpienv.sh
#   $MPISHARD_CLUSTER_EXEC mpirun $MPISHARD_CLUSTER_MPIRUN_FLAGS -n 4 .venv/bin/python x.py
#
# Slurm on the nodes: `bash scripts/slurm-local.sh start --cluster` runs slurmctld on
# node 0 and a slurmd in every node (state in $STATE/slurm); `exec` and `on` then set
# SLURM_CONF, so `bash scripts/cluster-local.sh exec sbatch -N 2 slurm/ddp.sbatch`.
set -euo pipefail

STATE=${MPISHARD_CLUSTER_DIR:-/run/mpishard-cluster}
PREFIX=mpishard
SWITCH=$PREFIX-sw
NET=10.213.0
SCRIPT=$(readlink -f "${BASH_SOURCE[0]}")

die() { echo "[cluster-local] $*" >&2; exit 1; }
say() { echo "[cluster-local] $*"; }

node_ns() { echo "$PREFIX-n$1"; }
node_host() { echo "$PREFIX-node$1"; }

# Why a cluster cannot be made here, or nothing (the tests skip with this reason).
unusable() {
  [ "$(id -u)" -eq 0 ] || { echo "not root (uid $(id -u)): network namespaces need root"; return; }
  command -v ip >/dev/null || { echo "no 'ip' command (iproute2)"; return; }
  command -v unshare >/dev/null || { echo "no 'unshare' command (util-linux)"; return; }
  command -v mpirun >/dev/null || { echo "no 'mpirun' on PATH"; return; }
  local probe=$PREFIX-probe$$
  if ! ip netns add "$probe" 2>/dev/null; then
    echo "cannot create a network namespace (ip netns add failed)"; return
  fi
  if ! ip -n "$probe" link add brp type bridge 2>/dev/null; then
    ip netns del "$probe"; echo "cannot create a bridge in a namespace (no bridge module?)"; return
  fi
  if ! ip -n "$probe" link add vp0 type veth peer name vp1 2>/dev/null; then
    ip netns del "$probe"; echo "cannot create a veth pair in a namespace"; return
  fi
  ip netns del "$probe"
}

stop() {
  local ns pid
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$PREFIX-(n[0-9]+|sw)$" || true); do
    # Processes left in a node (ranks of a killed job): by id, only those in our namespaces.
    for pid in $(ip netns pids "$ns" 2>/dev/null || true); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
    rm -rf "/etc/netns/$ns"
  done
  rmdir /etc/netns 2>/dev/null || true   # only when empty: it may hold others' files
  rm -rf "$STATE"
}

start() {
  local nodes=2 gbit="" slots=2
  while [ $# -gt 0 ]; do
    case $1 in
      --nodes) nodes=$2; shift 2 ;;
      --link-gbit) gbit=$2; shift 2 ;;
      --slots) slots=$2; shift 2 ;;
      *) die "unknown option $1 (expecting --nodes N, --link-gbit G, --slots S)" ;;
    esac
  done
  [[ $nodes =~ ^[0-9]+$ ]] && [ "$nodes" -ge 1 ] && [ "$nodes" -le 64 ] \
    || die "--nodes must be 1..64, got $nodes"
  [[ $slots =~ ^[0-9]+$ ]] && [ "$slots" -ge 1 ] || die "--slots must be >= 1, got $slots"
  [ -z "$gbit" ] || [[ $gbit =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--link-gbit must be a number, got $gbit"
  local want="nodes=$nodes gbit=${gbit:-none} slots=$slots"
  if [ -f "$STATE/config" ] && [ "$(cat "$STATE/config")" = "$want" ] && ip netns list | grep -q "^$SWITCH\b"; then
    say "already up ($want)"; print_env; return
  fi
  local why; why=$(unusable)
  [ -z "$why" ] || die "cannot make a cluster here: $why"
  stop
  mkdir -p "$STATE"
  ip netns add "$SWITCH"
  ip -n "$SWITCH" link add br0 type bridge
  ip -n "$SWITCH" link set br0 up
  local hosts="127.0.0.1 localhost"$'\n'
  for ((i = 0; i < nodes; i++)); do hosts+="$NET.$((i + 1)) $(node_host "$i")"$'\n'; done
  for ((i = 0; i < nodes; i++)); do
    local ns; ns=$(node_ns "$i")
    ip netns add "$ns"
    # veth: "eth0" inside the node, "p<i>" on the switch.
    ip link add "$PREFIX-v$i" type veth peer name "$PREFIX-p$i"
    ip link set "$PREFIX-v$i" netns "$ns"
    ip link set "$PREFIX-p$i" netns "$SWITCH"
    ip -n "$ns" link set "$PREFIX-v$i" name eth0
    ip -n "$SWITCH" link set "$PREFIX-p$i" name "p$i"
    ip -n "$SWITCH" link set "p$i" master br0 up
    ip -n "$ns" addr add "$NET.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    if [ -n "$gbit" ]; then
      # burst: 4 ms at the rate (a timer tick), at least 64 KiB (one GSO packet).
      local burst; burst=$(awk -v g="$gbit" 'BEGIN{b = g * 1e9 / 8 * 0.004; if (b < 65536) b = 65536; printf "%d", b}')
      ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "${gbit}gbit" burst "$burst" latency 50ms
      ip netns exec "$SWITCH" tc qdisc add dev "p$i" root tbf rate "${gbit}gbit" burst "$burst" latency 50ms
    fi
    mkdir -p "/etc/netns/$ns"
    printf '%s' "$hosts" >"/etc/netns/$ns/hosts"
    echo "$(node_host "$i") slots=$slots" >>"$STATE/hostfile.tmp"
  done
  mv "$STATE/hostfile.tmp" "$STATE/hostfile"
  local threads=$(( $(nproc) / (nodes * slots) )); [ "$threads" -ge 1 ] || threads=1
  echo "$threads" >"$STATE/threads"
  # The rsh agent: Open MPI calls it as `rsh HOST COMMAND...`; run COMMAND in HOST's
  # namespace under HOST's hostname, with this environment (mpirun's, as ssh would
  # give the remote orted its login environment).
  cat >"$STATE/rsh" <<EOF
#!/usr/bin/env bash
# Written by $SCRIPT: Open MPI's rsh agent for the namespace cluster.
host=\$1; shift
# A node taken down (cluster-local.sh down I) does not answer, as a dead machine.
if [ -e "$STATE/down-\$host" ]; then
  echo "mpishard cluster rsh: \$host is down (no route to host)" >&2; exit 255
fi
case \$host in
  $PREFIX-node*) node=\${host#$PREFIX-node} ;;
  *) echo "mpishard cluster rsh: unknown host \$host" >&2; exit 255 ;;
esac
# The nodes share this machine's cores: one BLAS thread per core and slot, not
# one per core per node (mpishard would give each rank alone on its node them all).
export OMP_NUM_THREADS=\${OMP_NUM_THREADS:-$threads}
exec ip netns exec $PREFIX-n\$node unshare --uts /bin/sh -c 'hostname "\$0" && exec /bin/sh -c "\$*"' "\$host" "\$@"
EOF
  chmod +x "$STATE/rsh"
  echo "$want" >"$STATE/config"
  local links="uncapped"; [ -z "$gbit" ] || links="capped at $gbit Gbit/s"
  say "up: $nodes nodes x $slots slots, links $links, subnet $NET.0/24"
  print_env
}

print_env() {
  local flags="--hostfile $STATE/hostfile --mca plm_rsh_agent $STATE/rsh --mca plm_rsh_no_tree_spawn 1"
  flags+=" --mca oob_tcp_if_include $NET.0/24 --mca btl_tcp_if_include $NET.0/24 --mca btl tcp,vader,self"
  cat >"$STATE/env" <<EOF
export MPISHARD_CLUSTER_HOSTFILE=$STATE/hostfile
export MPISHARD_CLUSTER_MPIRUN_FLAGS="$flags"
export MPISHARD_CLUSTER_EXEC="$SCRIPT exec"
export MPISHARD_CLUSTER_NODES=$(wc -l <"$STATE/hostfile")
EOF
  say "hostfile: $STATE/hostfile"
  say "environment: source $STATE/env"
  say "mpirun flags: $flags"
}

status() {
  if ! [ -f "$STATE/config" ]; then echo "[cluster-local] down"; return 1; fi
  say "up ($(cat "$STATE/config")); hostfile $STATE/hostfile, environment $STATE/env"
  local ns
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^$PREFIX-n[0-9]+$" | sort -V); do
    local addr qdisc
    addr=$(ip -n "$ns" -4 -o addr show eth0 | awk '{print $4}')
    qdisc=$(ip netns exec "$ns" tc qdisc show dev eth0 | head -1 | awk '{print $2} /rate/{for (i = 1; i < NF; i++) if ($i == "rate") print "rate", $(i + 1)}' | paste -sd' ')
    local state=""; [ -e "$STATE/down-$(node_host "${ns#"$PREFIX"-n}")" ] && state="  DOWN"
    echo "  $ns  eth0 $addr  qdisc $qdisc  processes $(ip netns pids "$ns" | wc -l)$state"
  done
  if [ -f "$STATE/slurm/slurm.conf" ]; then
    local f alive=()
    for f in "$STATE"/slurm/*.pid; do
      if [ -s "$f" ] && [ -d "/proc/$(cat "$f")" ]; then alive+=("$(basename "$f" .pid)"); fi
    done
    say "slurm: ${alive[*]:-no daemon running} (SLURM_CONF=$STATE/slurm/slurm.conf, inside a node)"
  fi
}

# A node fails: every process in it is killed (by id) and the rsh agent no longer
# reaches it; `up I` lets it answer again.
down() {
  local i=${1:?usage: down NODE_INDEX} ns pid
  ns=$(node_ns "$i")
  ip netns list | grep -q "^$ns\b" || die "no node $i ($ns)"
  touch "$STATE/down-$(node_host "$i")"
  for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null || true; done
  say "node $i ($(node_host "$i")) is down"
}

# Run CMD on node I: in its network namespace, under its host name. With the
# cluster's Slurm up (scripts/slurm-local.sh start --cluster), Slurm's commands
# there use its configuration (SLURM_CONF): `exec sbatch -N 2 slurm/ddp.sbatch`.
on() {
  local i=${1:?usage: on NODE_INDEX CMD...}; shift
  [ -f "$STATE/config" ] || die "no cluster is up (start it first)"
  ip netns list | grep -q "^$(node_ns "$i")\b" || die "no node $i ($(node_ns "$i"))"
  [ $# -gt 0 ] || die "usage: on NODE_INDEX CMD..."
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(cat "$STATE/threads")}   # as in the rsh agent
  [ ! -f "$STATE/slurm/slurm.conf" ] || export SLURM_CONF="$STATE/slurm/slurm.conf"
  exec ip netns exec "$(node_ns "$i")" unshare --uts /bin/sh -c 'hostname "$0" && exec "$@"' "$(node_host "$i")" "$@"
}

case ${1:-} in
  start) shift; start "$@" ;;
  down) shift; down "$@" ;;
  up) shift; rm -f "$STATE/down-$(node_host "${1:?usage: up NODE_INDEX}")"; say "node $1 answers again" ;;
  stop) stop; say "down" ;;
  status) status ;;
  check) why=$(unusable); if [ -n "$why" ]; then echo "$why"; exit 1; fi; echo ok ;;
  exec) shift; on 0 "$@" ;;
  on) shift; on "$@" ;;
  *) die "usage: $0 start --nodes N [--link-gbit G] [--slots S] | stop | status | check | down I | up I | exec CMD... | on I CMD..." ;;
esac
