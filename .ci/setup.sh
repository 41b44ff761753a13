#!/usr/bin/env bash
# Creates .venv and installs areal_lce for its tests: torch, the project (editable), megatron-core.
# Order matters: torch first, so nothing later pulls another build; then the project; then megatron-core
# 0.19.2 without its Python>=3.12 guard (all of it imports on 3.10 and 3.11).
# torch comes from the configured package index. On PyPI the Linux x86_64 torch wheel is the CUDA build
# (with its nvidia-* packages, several GB), on a CPU-only machine too; PyTorch's CPU build (a few hundred
# MB) comes from its own index:  TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash .ci/setup.sh
# (a machine whose pip finds a CPU wheel of torch 2.13.0 locally takes that one either way).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  TORCH=torch==2.13.0
  if command -v nvidia-smi >/dev/null 2>&1; then TORCH=torch; fi
  python -m pip install -q "$TORCH" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
python -m pip install -q "numpy<2.5" "triton==3.7.1" transformers safetensors pyyaml packaging tqdm matplotlib pytest "import-linter>=2.1" \
  "setuptools>=77"  # tests/train/test_install.py builds the wheel with this venv's setuptools (no build isolation)
# trainer.loggers=tensorboard's tests: the event writer and reader need tensorboard, protobuf and absl only
# (its server's grpcio, data server, werkzeug, markdown: 40 MB more, left out; `pip install .[tensorboard]` has them)
python -m pip install -q --no-deps "tensorboard==2.21.0" "protobuf>=3.19.6,!=4.24.0" "absl-py>=0.4"
python -m pip install -q --no-deps -e .
python -m pip install -q --no-deps --ignore-requires-python "megatron-core==0.19.2"
# megatron-core 0.16.1 aside (no output_processor seam): the tests run the legacy capture seam on it
[ -d .venv/megatron-legacy/megatron ] || python -m pip install -q --no-deps --target .venv/megatron-legacy "megatron-core==0.16.1"
# verl 0.9.1 aside: the verl adapter's tests load verl's own torch implementation of its op from it
[ -d .venv/verl-aside/verl ] || python -m pip install -q --no-deps --target .venv/verl-aside "verl==0.9.1"
python -c "import torch, triton, transformers, megatron.core; print('areal_lce env: torch', torch.__version__, 'triton', triton.__version__, 'megatron-core', megatron.core.__version__)" 2>/dev/null
