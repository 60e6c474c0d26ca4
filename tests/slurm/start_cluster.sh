#!/usr/bin/env bash
# A real one-node SLURM on this machine for the tests marked `slurm` (tests/slurm_cluster.py
# runs it once per session; .ci/run runs it before the tests). Debian's slurm-wlm 22.05 as
# root without systemd: munged, MariaDB, slurmdbd (the Snakemake executor plugin polls job
# states with sacct), slurmctld and slurmd; the node has this machine's cores and memory
# (less a margin), two fake GPUs (character devices) and two partitions, `cpu` (default)
# and `gpu`.
#
#   tests/slurm/start_cluster.sh            # installs the packages if they are missing
#   tests/slurm/start_cluster.sh --no-install
#
# Idempotent: where the cluster already answers it only checks it. Ends with one line,
# `slurm cluster up: node=... cpus=... mem_mb=... gpus=2 cpu_partition=cpu gpu_partition=gpu`,
# or exits 1 with one line `slurm cluster: <reason>` on stderr. Daemon logs: /var/log/slurm/.
set -uo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
CLUSTER=ampflow
ACCOUNT=ampflow
CPU_PARTITION=cpu
GPU_PARTITION=gpu
GPUS=2
MEM_MARGIN_MB=1024
DBPASS=ampflow-test
MARK="# written by ampflow tests/slurm/start_cluster.sh"
INSTALL=1
[ "${1:-}" = "--no-install" ] && INSTALL=0

fail() { echo "slurm cluster: $*" >&2; exit 1; }
# wait_for SECONDS COMMAND...: until COMMAND succeeds
wait_for() {
    local n=$(($1 * 4)); shift
    for _ in $(seq "$n"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.25; done
    return 1
}

[ "$(id -u)" = 0 ] || fail "needs root (daemons, /etc/slurm, device nodes); running as $(id -un)"

HOST="$(hostname -s)"
CPUS="$(nproc --all)"
MEM=$(( $(free -m | awk '/^Mem:/ {print $2}') - MEM_MARGIN_MB ))
summary="node=$HOST cpus=$CPUS mem_mb=$MEM gpus=$GPUS cpu_partition=$CPU_PARTITION gpu_partition=$GPU_PARTITION"

node_ready() {
    local state
    state="$(sinfo -h -N -n "$HOST" -o %t 2>/dev/null | head -n1)"
    case "$state" in idle|mix|alloc|comp) return 0 ;; *) return 1 ;; esac
}

render() {  # render TEMPLATE: substitute the @NAMES@
    sed -e "s/@CLUSTER@/$CLUSTER/g" -e "s/@HOST@/$HOST/g" -e "s/@CPUS@/$CPUS/g" -e "s/@MEM@/$MEM/g" \
        -e "s/@GPUS@/$GPUS/g" -e "s/@LASTGPU@/$((GPUS - 1))/g" -e "s/@DBPASS@/$DBPASS/g" \
        -e "s/@CPU_PARTITION@/$CPU_PARTITION/g" -e "s/@GPU_PARTITION@/$GPU_PARTITION/g" "$1"
}
fill() {  # fill TEMPLATE DEST MODE; false when DEST already holds it
    render "$1" > "$2.new" && chmod "$3" "$2.new"
    if cmp -s "$2.new" "$2"; then rm -f "$2.new"; return 1; fi
    mv "$2.new" "$2"
}

current() {  # the installed configuration is this script's
    local name
    for name in slurm slurmdbd gres; do
        render "$HERE/$name.conf.in" | cmp -s - "/etc/slurm/$name.conf" || return 1
    done
}

# ---------------------------------------------------------------- already running?
if command -v sinfo >/dev/null 2>&1 && current && node_ready && sacct -n -X -S now-1minutes >/dev/null 2>&1; then
    echo "slurm cluster up: $summary"
    exit 0
fi

# ---------------------------------------------------------------- packages
missing=()
for exe in /usr/sbin/slurmctld /usr/sbin/slurmd /usr/sbin/slurmdbd /usr/sbin/munged /usr/sbin/mariadbd; do
    [ -x "$exe" ] || missing+=("$exe")
done
if [ ${#missing[@]} -gt 0 ]; then
    [ "$INSTALL" = 1 ] || fail "missing ${missing[*]} (and --no-install)"
    command -v apt-get >/dev/null 2>&1 || fail "missing ${missing[*]} and no apt-get to install slurm-wlm"
    pkgs=(slurm-wlm munge slurmdbd mariadb-server)
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q "${pkgs[@]}" >/tmp/ampflow-slurm-apt.log 2>&1 ||
        { apt-get update -q >>/tmp/ampflow-slurm-apt.log 2>&1 &&
          apt-get install -y -q "${pkgs[@]}" >>/tmp/ampflow-slurm-apt.log 2>&1; } ||
        fail "apt-get install ${pkgs[*]} failed: $(tail -n1 /tmp/ampflow-slurm-apt.log)"
fi

if [ -f /etc/slurm/slurm.conf ] && ! grep -qF "$MARK" /etc/slurm/slurm.conf; then
    fail "/etc/slurm/slurm.conf exists and was not written by this script: not touching a real cluster"
fi

mkdir -p /var/log/slurm /var/spool/slurmctld /var/spool/slurmd /run/munge /run/mysqld
chown munge:munge /run/munge
chown mysql:mysql /run/mysqld

# ---------------------------------------------------------------- munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    [ -f /etc/munge/munge.key ] || /usr/sbin/mungekey -c >/dev/null 2>&1 || fail "no /etc/munge/munge.key"
    chown munge:munge /etc/munge/munge.key && chmod 600 /etc/munge/munge.key
    su -s /bin/sh munge -c /usr/sbin/munged || fail "munged did not start"
    wait_for 10 sh -c 'munge -n | unmunge' || fail "munge -n | unmunge fails after starting munged"
fi

# ---------------------------------------------------------------- MariaDB + slurmdbd
if ! mariadb -e 'select 1' >/dev/null 2>&1; then
    if [ ! -d /var/lib/mysql/mysql ]; then
        mariadb-install-db --user=mysql >/var/log/slurm/mariadb-install.log 2>&1 ||
            fail "mariadb-install-db failed (see /var/log/slurm/mariadb-install.log)"
    fi
    setsid /usr/sbin/mariadbd --user=mysql >/var/log/slurm/mariadbd.log 2>&1 < /dev/null &
    wait_for 60 mariadb -e 'select 1' || fail "mariadbd did not answer within 60 s (see /var/log/slurm/mariadbd.log)"
fi
mariadb -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DBPASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;" ||
    fail "cannot create the accounting database in MariaDB"

mkdir -p /etc/slurm
changed=0
fill "$HERE/slurmdbd.conf.in" /etc/slurm/slurmdbd.conf 600 && changed=1
fill "$HERE/slurm.conf.in" /etc/slurm/slurm.conf 644 && changed=1
fill "$HERE/gres.conf.in" /etc/slurm/gres.conf 644 && changed=1
for i in $(seq 0 $((GPUS - 1))); do
    [ -e "/dev/fakegpu$i" ] || mknod "/dev/fakegpu$i" c 195 "$i" || fail "mknod /dev/fakegpu$i failed"
done

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if [ "$changed" = 1 ]; then  # a changed configuration: restart what runs with the old one
    for d in slurmd slurmctld slurmdbd; do
        if running "/run/$d.pid"; then
            pid="$(cat "/run/$d.pid")"; kill "$pid"
            wait_for 20 sh -c "! kill -0 $pid" || fail "$d (pid $pid) did not stop"
        fi
    done
fi

if ! running /run/slurmdbd.pid; then
    /usr/sbin/slurmdbd || fail "slurmdbd did not start (see /var/log/slurm/slurmdbd.log)"
fi
wait_for 60 sacctmgr -n show cluster || fail "slurmdbd does not answer sacctmgr (see /var/log/slurm/slurmdbd.log)"
sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER" >/dev/null ||
    fail "sacctmgr add cluster $CLUSTER failed"
sacctmgr -n -P show account format=account | grep -qx "$ACCOUNT" || sacctmgr -i add account "$ACCOUNT" >/dev/null ||
    fail "sacctmgr add account $ACCOUNT failed"
sacctmgr -n -P show assoc where user=root account="$ACCOUNT" format=user | grep -qx root ||
    sacctmgr -i add user root account="$ACCOUNT" defaultaccount="$ACCOUNT" >/dev/null ||
    fail "sacctmgr add user root failed"

if ! running /run/slurmctld.pid; then
    /usr/sbin/slurmctld || fail "slurmctld did not start (see /var/log/slurm/slurmctld.log)"
fi
wait_for 30 scontrol ping || fail "slurmctld does not answer scontrol ping (see /var/log/slurm/slurmctld.log)"
if ! running /run/slurmd.pid; then
    /usr/sbin/slurmd || fail "slurmd did not start (see /var/log/slurm/slurmd.log)"
fi

# a node left down or drained by an earlier start comes back
if ! wait_for 30 node_ready; then
    scontrol update nodename="$HOST" state=resume >/dev/null 2>&1
    wait_for 30 node_ready ||
        fail "node $HOST is not idle: $(sinfo -h -N -n "$HOST" -o '%t %E' | head -n1) (see /var/log/slurm/slurmd.log)"
fi
wait_for 30 sacct -n -X -S now-1minutes || fail "sacct does not answer (accounting through slurmdbd)"
echo "slurm cluster up: $summary"
