#!/usr/bin/env bash
# One rollout engine: run by `srun --ntasks-per-node=ENGINES_PER_NODE` from slurm/train.sbatch, one
# task per engine. Picks the engine's ports from its own per-node slot (B31: SLURM_LOCALID -> a
# block of ports, no random offsets), publishes its URL for the batch script, then becomes the
# server: SGLang or vLLM (ROLLOUT_BACKEND) on GPUs, the embedded `megatron-rl rollout-server` in CPU
# mode (with `--api-dialect vllm` for ROLLOUT_BACKEND=vllm: vLLM's API, its CPU stand-in).
# Env (from train.sbatch): JOB_DIR, PYTHON, REPO, MEGATRON_RL_DEVICE, MODEL_PATH, ROLLOUT_BASE_PORT,
# ROLLOUT_TP_SIZE, ROLLOUT_MEM_FRACTION, SGLANG_EXTRA_ARGS, ROLLOUT_SEED, ROLLOUT_BACKEND, VLLM_PYTHON,
# JOB_VLLM_EXTRA_ARGS (the recipe's rollout.vllm_extra_args), VLLM_EXTRA_ARGS, and for Mixture-of-Experts
# models ROLLOUT_EP_SIZE (expert parallelism inside the engine, checked by jobtool.py check) and
# ROUTER_REPLAY (1: the recipe's actor.router_replay; engines return the routed experts).
set -euo pipefail

node="${SLURMD_NODENAME:?not inside a Slurm step}"
slot="${SLURM_LOCALID:?}"
ip=$(awk -v n="$node" '$1 == n {print $2}' "$JOB_DIR/hosts")
if [ -z "$ip" ]; then
  echo "engine.sh: node $node is not in $JOB_DIR/hosts" >&2
  exit 2
fi
# claimed for this job (--job): another job starting on the node meanwhile skips them
claim=(); [ -n "${SLURM_JOB_ID:-}" ] && claim=(--job "$SLURM_JOB_ID")
ports=$("$PYTHON" "$REPO/slurm/jobtool.py" ports --host "$ip" --base "$ROLLOUT_BASE_PORT" --slot "$slot" --count 3 \
  "${claim[@]}")
read -r port nccl_port dist_port <<< "$ports"
url="http://$ip:$port"
echo "engine $SLURM_PROCID on $node slot $slot: $url (nccl port $nccl_port, dist-init port $dist_port)"
# the batch script waits for one file per engine; the name orders engines by task id
printf '%s\n' "$url" > "$JOB_DIR/urls/$(printf '%05d' "$SLURM_PROCID").tmp"
mv "$JOB_DIR/urls/$(printf '%05d' "$SLURM_PROCID").tmp" "$JOB_DIR/urls/$(printf '%05d' "$SLURM_PROCID")"

ep_size="${ROLLOUT_EP_SIZE:-1}"
routed=(); [ "${ROUTER_REPLAY:-0}" = 1 ] && routed=(--enable-return-routed-experts)
if [ "$MEGATRON_RL_DEVICE" = gpu ]; then
  # engine `slot` owns GPUs [slot*TP, (slot+1)*TP) of its node
  first=$(( slot * ROLLOUT_TP_SIZE ))
  CUDA_VISIBLE_DEVICES=$(seq -s, "$first" $(( first + ROLLOUT_TP_SIZE - 1 )))
  export CUDA_VISIBLE_DEVICES
  if [ "${ROLLOUT_BACKEND:-sglang}" = vllm ]; then
    # `vllm serve` exactly as `megatron-rl train` starts it (launcher.build_vllm_command, via jobtool);
    # its NCCL weight transfer and pause routes need dev mode. vLLM takes its internal ports from
    # the OS (bound, not random offsets); only the HTTP port is picked here.
    line=$("$PYTHON" "$REPO/slurm/jobtool.py" vllm-cmd --python "${VLLM_PYTHON:-python}" --model "$MODEL_PATH" \
      --host "$ip" --port "$port" --tp-size "$ROLLOUT_TP_SIZE" --gpu-memory-utilization "$ROLLOUT_MEM_FRACTION" \
      --seed "$ROLLOUT_SEED" --ep-size "$ep_size" "${routed[@]}" \
      --extra-args "${JOB_VLLM_EXTRA_ARGS:-}" --extra-args "${VLLM_EXTRA_ARGS:-}")
    eval "cmd=($line)"   # shell-quoted by jobtool (shlex.join)
    export VLLM_SERVER_DEV_MODE=1
    exec "${cmd[@]}"
  fi
  # log-probs of the unscaled policy, as the trainer computes them (launcher.SGLANG_ENV)
  export SGLANG_RETURN_ORIGINAL_LOGPROB=1
  # MoE: the experts split over the engine's GPUs (--ep-size, as launcher.build_sglang_command) and the
  # routed experts recorded for router replay; SGLANG_EXTRA_ARGS come last (a repeated flag's last value wins)
  moe=(); [ "$ep_size" -gt 1 ] && moe=(--ep-size "$ep_size")
  # shellcheck disable=SC2086  # SGLANG_EXTRA_ARGS is a list of flags
  exec "$PYTHON" -m sglang.launch_server --model-path "$MODEL_PATH" --tp-size "$ROLLOUT_TP_SIZE" \
    --host "$ip" --port "$port" --nccl-port "$nccl_port" --dist-init-addr "$ip:$dist_port" \
    --mem-fraction-static "$ROLLOUT_MEM_FRACTION" --random-seed "$ROLLOUT_SEED" "${moe[@]}" "${routed[@]}" \
    ${SGLANG_EXTRA_ARGS:-}
else
  # the embedded server speaks the engine's HTTP API (SGLang's, or vLLM's with --api-dialect vllm);
  # it has no NCCL/dist-init ports (gloo, one process)
  dialect=(); [ "${ROLLOUT_BACKEND:-sglang}" = vllm ] && dialect=(--api-dialect vllm)
  exec "$PYTHON" -m megatron_rl.cli rollout-server --model-path "$MODEL_PATH" --host "$ip" --port "$port" \
    --random-seed "$ROLLOUT_SEED" "${dialect[@]}" "${routed[@]}"
fi
