#!/usr/bin/env bash
# Creates .venv and installs areal_lce with its CPU stack (no CUDA packages on a CPU-only machine).
# Order matters: torch first, pinned, so nothing later pulls a CUDA build; then the
# project; then megatron-core 0.19.2 without its Python>=3.12 guard (all of it imports on 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then python -m pip install -q torch; else python -m pip install -q torch==2.13.0; fi
fi
python -m pip install -q "numpy<2.5" "triton==3.7.1" transformers safetensors pyyaml packaging tqdm matplotlib pytest "import-linter>=2.1" "tensorboard==2.21.0"
python -m pip install -q --no-deps -e .
python -m pip install -q --no-deps --ignore-requires-python "megatron-core==0.19.2"
# megatron-core 0.16.1 aside (no output_processor seam): the tests run the legacy capture seam on it
[ -d .venv/megatron-legacy/megatron ] || python -m pip install -q --no-deps --target .venv/megatron-legacy "megatron-core==0.16.1"
# verl 0.9.1 aside: the verl adapter's tests load verl's own torch implementation of its op from it
[ -d .venv/verl-aside/verl ] || python -m pip install -q --no-deps --target .venv/verl-aside "verl==0.9.1"
python -c "import torch, triton, transformers, megatron.core; print('areal_lce env: torch', torch.__version__, 'triton', triton.__version__, 'megatron-core', megatron.core.__version__)" 2>/dev/null
