#!/usr/bin/env bash
# Create .venv and install Spotlight with its test tools: bash scripts/setup.sh
# Installs a CPU torch first when no CUDA device is present, so the package's plain `torch`
# range is already satisfied and pip never pulls a multi-GB CUDA build onto a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q "torch>=2.4"
  else
    pip install -q "torch==${SPOTLIGHT_CPU_TORCH:-2.13.0}"
  fi
fi
# The rest with uv when it installs (the same packages as pip, resolved in seconds instead of ~2
# minutes of pip's CPU time); pip otherwise. torch is already in the venv, so neither pulls another.
if { [ -x .venv/bin/uv ] || pip install -q uv 2>/dev/null; } && uv pip install -q --python .venv/bin/python -e ".[dev]"; then
  :
else
  pip install -q -e ".[dev]"
fi
# SkyPilot, which launches the cluster files in launch/skypilot/ and whose own parser a test runs,
# in a venv of its own: it pins click<8.2, which in .venv would hold diffusers below 0.42.
if [ ! -x .venv-sky/bin/python ] || ! .venv-sky/bin/python -c "import sky" 2>/dev/null; then
  "$PY" -m venv .venv-sky
  if [ -x .venv/bin/uv ]; then
    .venv/bin/uv pip install -q --python .venv-sky/bin/python "skypilot>=0.10"
  else
    .venv-sky/bin/pip install -q "skypilot>=0.10"
  fi
fi
python -c "import torch, diffusers, zmq, msgpack; print('spotlight setup ok: torch', torch.__version__, '| diffusers', diffusers.__version__, '| cuda', torch.cuda.is_available())"
