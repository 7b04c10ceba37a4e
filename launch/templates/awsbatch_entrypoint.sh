#!/bin/bash
# Container entrypoint for an AWS Batch multi-node parallel job (rendered by `python -m launch render awsbatch`).
# Every node runs this script. The main node collects the children's addresses over TCP (python -m launch
# hostfile --from awsbatch), all nodes receive the same hostfile, and each starts its own DeepSpeed launcher
# with --no_ssh (no sshd in the container). Arguments are passed to the training script after --config.
# Dry run (prints the deepspeed command): WP_DRY_RUN=1.
set -euo pipefail

WP_REPO_DEFAULT={{REPO}}
WP_REPO=${WP_REPO:-$WP_REPO_DEFAULT}
WP_CONFIG_DEFAULT={{CONFIG}}
WP_CONFIG=${WP_CONFIG:-$WP_CONFIG_DEFAULT}
WP_SCRIPT_DEFAULT={{SCRIPT}}
WP_SCRIPT=${WP_SCRIPT:-$WP_SCRIPT_DEFAULT}
WP_PROFILE_DEFAULT={{PROFILE}}
WP_PROFILE=${WP_PROFILE:-$WP_PROFILE_DEFAULT}
WP_GPUS_PER_NODE_DEFAULT={{GPUS_PER_NODE}}
WP_GPUS_PER_NODE=${WP_GPUS_PER_NODE:-$WP_GPUS_PER_NODE_DEFAULT}
WP_MASTER_PORT_DEFAULT={{MASTER_PORT}}
WP_MASTER_PORT=${WP_MASTER_PORT:-$WP_MASTER_PORT_DEFAULT}
WP_REGISTRATION_PORT_DEFAULT={{REGISTRATION_PORT}}
WP_REGISTRATION_PORT=${WP_REGISTRATION_PORT:-$WP_REGISTRATION_PORT_DEFAULT}
WP_MODE_DEFAULT={{MODE}}
WP_MODE=${WP_MODE:-$WP_MODE_DEFAULT}  # deepspeed: one launcher per node; elastic: launch elastic per node
WP_MIN_NODES_DEFAULT={{MIN_NODES}}
WP_MIN_NODES=${WP_MIN_NODES:-$WP_MIN_NODES_DEFAULT}
WP_MAX_RESTARTS_DEFAULT={{MAX_RESTARTS}}
WP_MAX_RESTARTS=${WP_MAX_RESTARTS:-$WP_MAX_RESTARTS_DEFAULT}
WP_WORK=${WP_WORK:-/tmp/wikipretrain-launch}
WP_PYTHON=${WP_PYTHON:-python}
WP_DEEPSPEED=${WP_DEEPSPEED:-deepspeed}

run() {
    if [ -n "${WP_DRY_RUN:-}" ]; then printf '%q ' "$@"; printf '\n'; else exec "$@"; fi
}

cd "$WP_REPO"
mkdir -p "$WP_WORK"
ip_args=()
if [ -n "${WP_NODE_IP:-}" ]; then ip_args=(--ip "$WP_NODE_IP"); fi
"$WP_PYTHON" -m launch env --profile "$WP_PROFILE" --out "$WP_WORK/deepspeed_env"
"$WP_PYTHON" -m launch hostfile --from awsbatch --slots "$WP_GPUS_PER_NODE" --port "$WP_REGISTRATION_PORT" \
    --out "$WP_WORK/hostfile" --env-out "$WP_WORK/node.env" "${ip_args[@]}"
set -a
. "$WP_WORK/deepspeed_env"   # --no_ssh: DeepSpeed's runner does not read .deepspeed_env, so source it here
. "$WP_WORK/node.env"        # NODE_RANK, MASTER_ADDR, NUM_NODES (validated integers and addresses)
set +a
if [ "$WP_MODE" = elastic ]; then
    # torch's elastic agent on every node, meeting on the main node: failures restart the job from the last
    # checkpoint on the nodes left; exit 3 (preempted, saved) is retried by the job's retry strategy.
    run "$WP_PYTHON" -m launch elastic --nodes "$WP_MIN_NODES:$NUM_NODES" --procs-per-node "$WP_GPUS_PER_NODE" \
        --max-restarts "$WP_MAX_RESTARTS" --rendezvous "$MASTER_ADDR:$WP_MASTER_PORT" \
        --job-id "${AWS_BATCH_JOB_ID%%#*}" -- --config "$WP_CONFIG" "$@"   # one id: "JOB#NODE" on children
else
    run "$WP_DEEPSPEED" --no_ssh --node_rank "$NODE_RANK" --hostfile "$WP_WORK/hostfile" \
        --master_addr "$MASTER_ADDR" --master_port "$WP_MASTER_PORT" "$WP_SCRIPT" --config "$WP_CONFIG" "$@"
fi
