#!/bin/bash
# A real two-node Slurm on this machine, for tests (tests/slurm, `make test-slurm`).
#
#   scripts/slurm_local.sh start DIR    install slurm-wlm + munge if absent, start the cluster
#   scripts/slurm_local.sh status DIR   sinfo + squeue; exit 1 when the controller does not answer
#   scripts/slurm_local.sh stop DIR     cancel its jobs, stop its daemons
#
# Exit 2 on an error, 3 when Slurm cannot be had here (not root, apt-get failed): tests skip on 3.
# Everything lives under DIR: slurm.conf, a private munged (own key, socket and pid file), the
# controller's state, each node's spool, logs, and jobcomp.txt (one line per finished job: there
# is no slurmdbd, so no sacct). Clients need the config: `export SLURM_CONF=DIR/slurm.conf`
# (start prints it). Needs root (slurmd runs jobs as their user; apt-get).
#
# Two nodes, n1 and n2, on loopback: two slurmd on one host, each with its own port, NodeAddr
# 127.0.0.1 (node names do not resolve; the launcher reads NodeAddr), proctrack/linuxproc and
# task/none (no cgroups in a container). Each node claims every CPU of the machine, so jobs on
# both nodes share the real cores. Ports: SLURM_LOCAL_PORT (default 16817) for slurmctld, +1 and
# +2 for the nodes.
set -euo pipefail

die() {
    echo "slurm_local.sh: $*" >&2
    exit 2
}

unavailable() {
    echo "slurm_local.sh: $*" >&2
    exit 3
}

usage() {
    die "usage: scripts/slurm_local.sh start|stop|status DIR"
}

[[ $# -eq 2 ]] || usage
action=$1
mkdir -p "$2"
DIR=$(cd "$2" && pwd)
CONF=$DIR/slurm.conf
MUNGE_SOCKET=$DIR/munge/munge.socket
NODES=(n1 n2)
export SLURM_CONF=$CONF

install_packages() {
    local missing=0 cmd
    for cmd in slurmctld slurmd sbatch munged mungekey; do
        command -v "$cmd" >/dev/null 2>&1 || missing=1
    done
    ((missing)) || return 0
    echo "slurm_local.sh: installing slurm-wlm and munge (apt-get)" >&2
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -q slurm-wlm munge >/dev/null; then
        command -v apt-get >/dev/null 2>&1 || unavailable "no slurm-wlm/munge and no apt-get"
        apt-get update -q >/dev/null || unavailable "apt-get update failed: no Debian mirror?"
        apt-get install -y -q slurm-wlm munge >/dev/null ||
            unavailable "apt-get install slurm-wlm munge failed"
    fi
}

# pid from a pid file, if that process is alive.
live_pid() {
    local pid
    [[ -s $1 ]] || return 1
    pid=$(<"$1")
    kill -0 "$pid" 2>/dev/null || return 1
    echo "$pid"
}

start_munge() {
    mkdir -p "$DIR/munge"
    chmod 0700 "$DIR/munge"
    live_pid "$DIR/munge/munged.pid" >/dev/null && return 0
    [[ -s $DIR/munge/munge.key ]] || mungekey -c -k "$DIR/munge/munge.key"
    # --force: DIR may sit under /tmp, whose permissions munged would otherwise refuse.
    munged --force --socket="$MUNGE_SOCKET" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
        --seed-file="$DIR/munge/munged.seed" 2>>"$DIR/munge/munged.err" ||
        die "munged did not start: see $DIR/munge/munged.log"
}

write_conf() {
    local host port cpus mem_mb real_mb i
    host=$(hostname -s)
    port=${SLURM_LOCAL_PORT:-16817}
    cpus=$(nproc)
    mem_mb=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
    # Both nodes report the whole machine; each may claim at most that, so half of it each.
    real_mb=$((mem_mb / 2 > 16000 ? 16000 : mem_mb / 2))
    mkdir -p "$DIR/state" "$DIR/log"
    {
        echo "# Written by scripts/slurm_local.sh: two nodes on loopback, for tests."
        echo "ClusterName=mrf8local"
        echo "SlurmctldHost=$host(127.0.0.1)"
        echo "SlurmctldPort=$port"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "AuthType=auth/munge"
        echo "CredType=cred/munge"
        echo "AuthInfo=socket=$MUNGE_SOCKET"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_CPU"
        echo "SchedulerType=sched/backfill"
        echo "MpiDefault=none"
        echo "SwitchType=switch/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        # No slurmdbd (no sacct): finished jobs are one line each here, and `scontrol show job`
        # remembers them for MinJobAge seconds.
        echo "JobCompType=jobcomp/filetxt"
        echo "JobCompLoc=$DIR/jobcomp.txt"
        echo "MinJobAge=120"
        echo "JobRequeue=1"
        echo "ReturnToService=2"
        echo "SlurmdParameters=config_overrides"
        echo "KillWait=10"
        echo "InactiveLimit=0"
        echo "StateSaveLocation=$DIR/state"
        echo "SlurmdSpoolDir=$DIR/spool/%n"
        echo "SlurmctldPidFile=$DIR/slurmctld.pid"
        echo "SlurmdPidFile=$DIR/slurmd-%n.pid"
        echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
        echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
        for i in "${!NODES[@]}"; do
            echo "NodeName=${NODES[i]} NodeHostname=$host NodeAddr=127.0.0.1" \
                "Port=$((port + 1 + i)) CPUs=$cpus RealMemory=$real_mb State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=$(
            IFS=,
            echo "${NODES[*]}"
        ) Default=YES MaxTime=INFINITE State=UP"
    } >"$CONF"
}

wait_idle() {
    local idle
    for _ in $(seq 60); do
        idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 == "idle"' | sort -u | wc -l)
        if ((idle == ${#NODES[@]})); then return 0; fi
        sleep 0.5
    done
    sinfo -N >&2 || true
    die "the nodes are not idle after 30 s: see $DIR/log/"
}

start() {
    [[ $(id -u) -eq 0 ]] || unavailable "needs root (slurmd, munged, apt-get)"
    install_packages
    start_munge
    if live_pid "$DIR/slurmctld.pid" >/dev/null; then
        echo "slurm_local.sh: already running in $DIR" >&2
    else
        write_conf
        mkdir -p "${NODES[@]/#/$DIR/spool/}"
        # -i: ignore state from an earlier run in DIR (its jobs are gone).
        slurmctld -f "$CONF" -i
        for node in "${NODES[@]}"; do
            slurmd -f "$CONF" -N "$node"
        done
    fi
    wait_idle
    echo "export SLURM_CONF=$CONF"
}

status() {
    live_pid "$DIR/slurmctld.pid" >/dev/null || {
        echo "slurm_local.sh: no slurmctld running for $DIR" >&2
        return 1
    }
    sinfo -N
    squeue
}

# SIGTERM pid $1 and wait up to 10 s for it to go.
stop_pid() {
    kill "$1" 2>/dev/null || return 0
    for _ in $(seq 50); do
        kill -0 "$1" 2>/dev/null || return 0
        sleep 0.2
    done
    kill -9 "$1" 2>/dev/null || true
}

stop() {
    local pid node
    if live_pid "$DIR/slurmctld.pid" >/dev/null; then
        # Jobs first, so that their steps (slurmstepd) end through Slurm.
        scancel --quiet --user="$(id -un)" 2>/dev/null || true
        for _ in $(seq 30); do
            [[ -z $(squeue -h 2>/dev/null) ]] && break
            sleep 1
        done
    fi
    for node in "${NODES[@]}"; do
        if pid=$(live_pid "$DIR/slurmd-$node.pid"); then stop_pid "$pid"; fi
    done
    if pid=$(live_pid "$DIR/slurmctld.pid"); then stop_pid "$pid"; fi
    if pid=$(live_pid "$DIR/munge/munged.pid"); then stop_pid "$pid"; fi
    echo "slurm_local.sh: stopped the cluster in $DIR" >&2
}

case $action in
start) start ;;
stop) stop ;;
status) status ;;
*) usage ;;
esac
