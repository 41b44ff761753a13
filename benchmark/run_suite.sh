#!/usr/bin/env bash
# The whole test suite (README's `python -m pytest -q tests`) on a GPU machine, within one device command
# (10 minutes): JUnit XML, logs and a manifest under $OUT. Usage, from the repository root on the device,
# with the megatron-core cp312 wheel (and, if wanted, import-linter's wheels) in the ignored .carry/:
#   GIT_SHA=<sha> OUT=bench_out bash benchmark/run_suite.sh
# Two phases, 9 minutes in all (SUITE_BUDGET_S); SUITE_PHASES=gpu or rest runs one of them:
#   gpu   every `gpu` test, in one process (they time, capture graphs and read memory: no neighbours on
#         the card); about 3 minutes on an H100 (benchmark/results/h100_check_main_3a416f2)
#   rest  everything else, the slow and distributed tests included (SUITE_REST_MARK narrows it), spread
#         over SUITE_WORKERS pytest-xdist workers (in the device image) one test file each (loadfile: a
#         module's fixtures and its torchrun launches stay in one worker); the Triton kernel tests run
#         their kernels on CUDA there (tests/helpers/kernel_device.py), not through the interpreter
# A phase still running at its limit gets SIGINT: pytest stops, writes its XML of the tests it finished,
# and the manifest marks the phase interrupted. A test hung past SUITE_TEST_TIMEOUT_S fails alone.
# tests/test_architecture.py (import-linter's layer contracts: static, the same on every machine) is
# deselected unless `lint-imports` is installed from .carry/.
# Files under $OUT (the device returns 8): manifest.json (benchmark/results_index.py's format, the counts
# in `what`), suite_summary.json (counts per phase, failing ids), suite_{gpu,rest}.xml, suite_{gpu,rest}.log.
set -u
OUT=${OUT:-bench_out}
BUDGET=${SUITE_BUDGET_S:-540}
GPU_LIMIT=${SUITE_GPU_S:-240}
WORKERS=${SUITE_WORKERS:-8}
PER_TEST=${SUITE_TEST_TIMEOUT_S:-240}
REST_MARK=${SUITE_REST_MARK:-not gpu}
PHASES=${SUITE_PHASES:-gpu rest}  # one phase per device command where both do not fit one (SUITE_PHASES=gpu, then rest)
has_phase() { case " $PHASES " in *" $1 "*) return 0 ;; esac; return 1; }
mkdir -p "$OUT"
start=$(date +%s)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .carry/*.whl > /dev/null 2>&1; then  # every wheel there (megatron-core; import-linter, grimp if carried)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH PATH=/tmp/site/bin:$PATH
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET  # the kernels compiled on CUDA; tests/helpers/kernel_device.py decides
common=(-q -p no:cacheprovider -o junit_family=xunit2 --durations=15)
python3 -c "import pytest_timeout" 2> /dev/null && common+=(--timeout "$PER_TEST")
command -v lint-imports > /dev/null || common+=(--deselect tests/test_architecture.py)
spread=(-n "$WORKERS" --dist loadfile)
python3 -c "import xdist" 2> /dev/null || { spread=(); echo "no pytest-xdist: the rest runs in one process"; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
'cuda', torch.cuda.is_available(), torch.cuda.device_count())" | tee "$OUT/suite_gpu.log"

interrupted=()
phase() {  # name limit_s pytest-args...
  local name=$1 limit=$2; shift 2
  echo "=== $name (at most ${limit} s)"
  timeout -s INT -k 30 "$limit" python3 -m pytest "${common[@]}" --junitxml="$OUT/suite_$name.xml" "$@" \
    >> "$OUT/suite_$name.log" 2>&1
  local rc=$?
  echo "rc=$rc ($name)"
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then interrupted+=("$name"); fi  # timeout's codes: stopped at the limit
  tail -n 3 "$OUT/suite_$name.log"
}
# the gpu phase is the GPU session of tests/helpers/gpu_host.py (CUDA visible); the rest phase is its main session
# (CUDA hidden, every test as on a CPU-only host), without the test that would run the gpu tests a second time
export AREAL_LCE_TEST_GPU_SESSION=1
has_phase gpu && phase gpu "$GPU_LIMIT" -m gpu $(grep -rl "pytest.mark.gpu" tests --include="test_*.py")  # those files only: a short collection
unset AREAL_LCE_TEST_GPU_SESSION
left=$(( BUDGET - ($(date +%s) - start) - 20 ))  # 20 s for the manifest
[ "$left" -ge 60 ] || left=60
export OMP_NUM_THREADS=$(( $(nproc) / WORKERS > 0 ? $(nproc) / WORKERS : 1 ))  # the workers share the cores
has_phase rest && phase rest "$left" -m "$REST_MARK" --deselect tests/test_gpu_session.py ${spread[@]+"${spread[@]}"} tests
ran=(); xml=()
for p in gpu rest; do has_phase "$p" && { ran+=("$p"); xml+=("$OUT/suite_$p.xml"); }; done
python3 -m benchmark.suite_report --junit "${xml[@]}" --names "${ran[@]}" \
  --interrupted ${interrupted[@]+"${interrupted[@]}"} --out "$OUT" \
  --command "GIT_SHA=${GIT_SHA:-unknown} OUT=bench_out SUITE_WORKERS=$WORKERS bash benchmark/run_suite.sh"
