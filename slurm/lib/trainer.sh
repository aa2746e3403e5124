#!/usr/bin/env bash
# The trainer on one node: run by `srun --ntasks-per-node=1` on the trainer nodes from
# slurm/train.sbatch. Becomes torchrun (static rendezvous on the head node's IP, node rank = this
# task's rank in the step), which starts GPUS_PER_NODE ranks of `megatron-rl train`.
# Env (from train.sbatch): JOB_DIR, PYTHON, TRAINER_NODES, GPUS_PER_NODE, HEAD_IP, RDZV_PORT,
# STOP_TIMEOUT; the `megatron-rl train` arguments are in $JOB_DIR/trainer.args (one per line).
set -euo pipefail

node_rank="${SLURM_PROCID:?not inside a Slurm step}"
mapfile -t train_args < "$JOB_DIR/trainer.args"
# train.sbatch sends SIGUSR1 to the head node's torchrun only (pid file below); torchrun forwards it
# to its local ranks once each and waits STOP_TIMEOUT s for them to checkpoint; the ranks agree on
# stopping through an all-reduce, so the other nodes stop after the same step.
echo $$ > "$JOB_DIR/torchrun.$node_rank.pid"
exec "$PYTHON" -m torch.distributed.run \
  --nnodes "$TRAINER_NODES" --nproc-per-node "$GPUS_PER_NODE" --node-rank "$node_rank" \
  --master-addr "$HEAD_IP" --master-port "$RDZV_PORT" --max-restarts 0 \
  --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout "$STOP_TIMEOUT" \
  -m megatron_rl.cli train "${train_args[@]}"
