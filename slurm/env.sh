# shellcheck shell=bash
# slurm/env.sh - network and NCCL settings of every megatron-rl Slurm job, sourced by
# slurm/train.sbatch before any step starts (and so inherited by every srun step: trainer ranks,
# SGLang engines, the weight-sync group between them). Edit this one file per cluster; a value
# already set in the submitting environment wins (`MEGATRON_RL_IFACE=ib0 sbatch ...`).

# --- Interface selection -----------------------------------------------------------------------
# The interface whose IPv4 every node uses for the trainer rendezvous, the rollout servers' HTTP
# endpoints and the trainer -> rollout weight-sync group (CASES.md B31). Empty = the address Slurm
# knows the node by (its NodeAddr), which on multi-NIC clusters is often the slow management
# network. Name it (ib0, bond0, enp...): each node resolves that interface's IPv4 itself
# (slurm/jobtool.py ipv4) and a node that lacks the interface stops the job at once, naming the
# node. `lo` works on a one-node test cluster.
export MEGATRON_RL_IFACE="${MEGATRON_RL_IFACE:-}"

if [ -n "$MEGATRON_RL_IFACE" ]; then
  # NCCL's bootstrap/socket transport and gloo (CPU collectives, torch.distributed store
  # connections) use the same interface; without these they pick the first non-loopback one.
  export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$MEGATRON_RL_IFACE}"
  export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$MEGATRON_RL_IFACE}"
fi

# --- InfiniBand / RoCE (GPU jobs) --------------------------------------------------------------
# H100 nodes usually carry 8 ConnectX-7 HCAs (one per GPU). NCCL finds them on its own; pin them
# when a node also has storage/management HCAs NCCL should not use, e.g. "mlx5_0,mlx5_1,...".
export NCCL_IB_HCA="${NCCL_IB_HCA:-}"
[ -z "$NCCL_IB_HCA" ] && unset NCCL_IB_HCA
# RoCE needs the GID index of the RoCE v2 address (often 3); leave unset on native InfiniBand.
[ -n "${NCCL_IB_GID_INDEX:-}" ] && export NCCL_IB_GID_INDEX
# GPUDirect RDMA between GPU and HCA when they share a PCIe switch (PIX) or host bridge (PHB).
export NCCL_NET_GDR_LEVEL="${NCCL_NET_GDR_LEVEL:-PHB}"
# Set NCCL_IB_DISABLE=1 only on clusters without IB (falls back to TCP sockets on the interface).
[ -n "${NCCL_IB_DISABLE:-}" ] && export NCCL_IB_DISABLE

# --- Failure behaviour -------------------------------------------------------------------------
# A rank whose peer died raises instead of hanging until the collective timeout, so the job step
# fails and slurm/train.sbatch tears the other steps down.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
# NCCL's one-line-per-problem level; INFO prints the chosen transports (use it once per cluster).
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

# --- Megatron / CUDA ---------------------------------------------------------------------------
# megatron-core's requirement for overlapping TP communication with compute.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
# Python output reaches the per-step logs at once.
export PYTHONUNBUFFERED=1
