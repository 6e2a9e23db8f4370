#!/usr/bin/env bash
# Run the Tandem services on a Slurm login or service node, each as its own process, with PostgreSQL as
# the store and the Slurm backend for jobs. Compute nodes reach the services at this node's hostname.
#
#   deploy/slurm/tandem-services.sh [ENV_FILE]        # default ENV_FILE: deploy/slurm/tandem.env
#   TANDEM_ONE_PROCESS=1 deploy/slurm/tandem-services.sh   # all five in one process (`tandem up`)
#
# ENV_FILE holds TANDEM_* settings (see tandem.env.example). Stops every service on SIGINT/SIGTERM
# (each drains its calls) and exits when any of them exits. Needs the Tandem package installed in the
# Python on PATH (or TANDEM_PYTHON), and sbatch/squeue/sacct/scancel on PATH for the scheduler.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
env_file="${1:-$here/tandem.env}"
if [[ -f "$env_file" ]]; then
    set -a
    # shellcheck disable=SC1090
    source "$env_file"
    set +a
fi

: "${TANDEM_STORE_URL:?set TANDEM_STORE_URL to the PostgreSQL URL (postgresql://user:pass@host/db)}"
case "$TANDEM_STORE_URL" in
    postgresql://* | postgres://*) ;;
    *) echo "TANDEM_STORE_URL must be a PostgreSQL URL: several processes share the store" >&2; exit 2 ;;
esac

python="${TANDEM_PYTHON:-python3}"
node="${TANDEM_ADVERTISE_HOST:-$(hostname -f)}"
export TANDEM_HOST="${TANDEM_HOST:-0.0.0.0}"
export TANDEM_STATE_DIR="${TANDEM_STATE_DIR:-$HOME/.tandem-services}"
export TANDEM_SCHEDULER_BACKENDS="${TANDEM_SCHEDULER_BACKENDS:-[\"slurm\"]}"
export TANDEM_SCHEDULER_DEFAULT_BACKEND="${TANDEM_SCHEDULER_DEFAULT_BACKEND:-slurm}"
export TANDEM_SCHEDULER_SLURM__ENABLED="${TANDEM_SCHEDULER_SLURM__ENABLED:-true}"

declare -A ports=([gateway]=50050 [vault]=50051 [scheduler]=50052 [taskapp_proxy]=50053 [events]=50054)
for service in "${!ports[@]}"; do
    upper="${service^^}"
    port_var="TANDEM_PORTS__$upper"
    target_var="TANDEM_TARGETS__$upper"
    export "$port_var=${!port_var:-${ports[$service]}}"
    export "$target_var=${!target_var:-$node:${!port_var}}"  # what tasks on compute nodes dial
done

mkdir -p "$TANDEM_STATE_DIR/logs"
chmod 700 "$TANDEM_STATE_DIR"
if [[ -n "${TANDEM_MESH_KEY_FILE:-}" ]]; then  # the services read <state_dir>/mesh.key
    ln -sf "$TANDEM_MESH_KEY_FILE" "$TANDEM_STATE_DIR/mesh.key"
fi
if [[ ! -e "$TANDEM_STATE_DIR/mesh.key" && -z "${TANDEM_MESH_KEY:-}" ]]; then
    echo "no mesh key: set TANDEM_MESH_KEY_FILE (every process of the mesh needs the same key)" >&2
    exit 2
fi

if [[ -n "${TANDEM_ONE_PROCESS:-}" ]]; then
    exec "$python" -m gateway.cli up
fi

pids=()
stop() {
    trap - INT TERM
    kill -TERM "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
}
trap 'stop; exit 143' INT TERM

# Peers first: the gateway fronts all of them.
for module in services.events services.vault services.taskapp_proxy services.scheduler gateway; do
    name="${module#services.}"
    "$python" -m "$module" >>"$TANDEM_STATE_DIR/logs/$name.log" 2>&1 &
    pids+=("$!")
    echo "started $module (pid $!), log $TANDEM_STATE_DIR/logs/$name.log"
done
echo "Tandem services up; gateway at $TANDEM_TARGETS__GATEWAY"

status=0
wait -n || status=$?
echo "a service exited (status $status); stopping the others" >&2
stop
exit "$status"
