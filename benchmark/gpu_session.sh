#!/usr/bin/env bash
# One GPU lease: the GPU checks and benchmarks named on the command line, logs and JSON results packed
# into $OUT/results.tgz (the device returns few files). Usage, from the repository root on the GPU machine,
# with the megatron-core wheel in .carry/ (the GPU image has none):
#   bash benchmark/gpu_session.sh gpu_check gpu_attention_check bench_packing bench_rollout
# Engine figures (issue 12, item 6): prof_engine bench_grpo bench_sft; LOGPROB_TOKENS=N ROUTES=materialised
# bench_grpo runs one route at a given rl.logprob_max_tokens; ROPE=off runs bench_sft / bench_grpo with
# model.rope_fusion off (megatron's unfused RoPE); GRAPHS=on|off: engine.model_cuda_graphs on both routes / off
# (default auto); COMPACT=on|off: engine.lce.compact_ignored true / false (default auto); STEPS=N: steps of bench_sft / bench_grpo (their first step and a graph capture step are
# included in step_s_all, the medians skip step 0); SFT_ROUNDS=R: bench_sft's paired rounds (SFT_LIMIT_S its time limit); ROUTES=a,b: bench_sft's routes (fused, fused_cache, megatron,
# megatron_fusedce, materialised). bench_head: the LM head alone at a 7B model's TP=2 rank shapes.
set -u
OUT=${OUT:-bench_out}
W=$OUT/work
mkdir -p "$W"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export AREAL_LCE_TEST_GPU_SESSION=1  # the pytest jobs here are GPU sessions: CUDA stays visible (tests/helpers/gpu_host.py)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$W/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$W/device.txt"
echo "commit ${GIT_SHA:-unknown}" >> "$W/device.txt"
run() {  # name timeout_s command...
  local name=$1 t=$2; shift 2
  echo "=== $name"
  timeout "$t" "$@" > "$W/$name.log" 2>&1
  echo "rc=$? ($name)"
  grep -v -i "warn\|deprecat" "$W/$name.log" | tail -n 14
}
for job in "$@"; do
  case $job in
    gpu_check) run gpu_check 240 python3 -m benchmark.op.gpu_check --out "$W" ;;
    gpu_attention_check) run gpu_attention_check 150 python3 -m benchmark.engine.gpu_attention_check --out "$W" ;;
    bench_packing) run bench_packing 300 python3 -m benchmark.engine.bench_packing --preset qwen2.5-0.5b --seqs 32 --micro-batch 4 \
          ${STEPS:+--steps $STEPS} --out "$W" ;;
    bench_packing_mem) run bench_packing_mem 420 python3 -m benchmark.engine.bench_packing --preset qwen2.5-0.5b --seqs 32 \
          --micro-batch 16 --micro-batch-padded 8 --routes fused ${STEPS:+--steps $STEPS} --out "$W" ;;
    bench_rollout) run bench_rollout 300 torchrun --nproc_per_node=1 -m benchmark.engine.bench_rollout --preset qwen2.5-0.5b --out "$W" ;;
    bench_lce) run bench_lce 480 python3 -m benchmark.op.bench_lce --shapes small,qwen7b,llama8b,wide_n --out "$W" ;;
    prof_engine) run prof_engine 200 torchrun --nproc_per_node=1 -m benchmark.engine.prof_engine --materialised --out "$W" ;;
    bench_grpo) run "bench_grpo${LOGPROB_TOKENS:+_$LOGPROB_TOKENS}${ROUTES:+_$ROUTES}${ROPE:+_rope_$ROPE}${GRAPHS:+_graphs_$GRAPHS}${COMPACT:+_compact_$COMPACT}" 300 torchrun --nproc_per_node=1 \
          -m benchmark.engine.bench_train --job grpo --preset qwen2.5-0.5b --prompts 16 --group 4 --micro-batch 16 \
          --prompt-len 256 --new-tokens 16 --steps ${STEPS:-3} ${LOGPROB_TOKENS:+--logprob-max-tokens $LOGPROB_TOKENS} \
          ${ROUTES:+--routes $ROUTES} ${ROPE:+--rope-fusion $ROPE} ${GRAPHS:+--model-graphs $GRAPHS} \
          ${COMPACT:+--compact-ignored $COMPACT} --out "$W" ;;
    bench_invariant) run bench_invariant 480 python3 -m benchmark.op.bench_invariant --rounds ${ROUNDS:-5} --out "$W" ;;
    bench_materialised) run bench_materialised 420 python3 -m benchmark.op.bench_materialised --rounds ${ROUNDS:-3} \
          --lean-blocks ${LEAN_BLOCKS:-4194304,8388608,67108864} --out "$W" ;;
    bench_select) run bench_select 500 python3 -m benchmark.op.bench_select --rounds ${ROUNDS:-3} --out "$W" ;;
    gpu_tests) run gpu_tests 500 python3 -m pytest -q -p no:cacheprovider -m gpu tests ;;  # every gpu-marked case
    gpu_kernels) run gpu_kernels 300 python3 -m pytest -q -p no:cacheprovider \
          tests/op/test_softcap_triton.py::test_in_kernel_tanh_is_within_its_absolute_bound \
          tests/op/backends/test_triton_select_rank.py tests/op/backends/test_triton_selected_picks.py \
          tests/op/backends/test_triton_outputs.py \
          tests/op/test_select.py::test_triton_topk_with_compacted_rows_is_the_same ;;  # interpreter tests whose kernels also run on CUDA
    bench_ignored) run bench_ignored 240 python3 -m benchmark.op.bench_ignored --out "$W" ;;
    bench_sft) run "bench_sft${ROPE:+_rope_$ROPE}${GRAPHS:+_graphs_$GRAPHS}" ${SFT_LIMIT_S:-300} torchrun --nproc_per_node=1 -m benchmark.engine.bench_train --job sft \
          --preset qwen2.5-0.5b --seq 2048 --micro-batch 4 --micro-batches 2 --steps ${STEPS:-5} --rounds ${SFT_ROUNDS:-1} ${ROPE:+--rope-fusion $ROPE} \
          ${GRAPHS:+--model-graphs $GRAPHS} ${ROUTES:+--routes $ROUTES} --out "$W" ;;
    bench_head) run bench_head 300 python3 -m benchmark.op.bench_head --rounds ${ROUNDS:-5} --out "$W" ;;
    job_sft|job_grpo)  # the job itself (checkpoints under /tmp, metrics kept); GRAPHS=on|off sets model_cuda_graphs
          cfg=configs/${job#job_}_qwen2.5_0.5b.yaml; name="$job${GRAPHS:+_graphs_$GRAPHS}"; dir=/tmp/$name
          run "$name" 400 torchrun --nproc_per_node=1 -m areal_lce.train "$cfg" trainer.steps=${STEPS:-12} \
              trainer.log_interval=1 trainer.output_dir="$dir" \
              ${GRAPHS:+engine.model_cuda_graphs=$([ "$GRAPHS" = on ] && echo true || echo false)}
          cp "$dir/metrics.jsonl" "$W/$name.metrics.jsonl" ;;
    cp_*) set -- ${job//_/ }; seq=$3; route=$2
          run "cp_${route}_${seq}" 200 torchrun --nproc_per_node=2 -m benchmark.engine.bench_cp --seq "$seq" --route "$route" \
              ${RECOMPUTE:+--recompute} ${STEPS:+--steps $STEPS} --out "$W" ;;
    *) echo "unknown job $job" ;;
  esac
done
tar czf "$OUT/results.tgz" -C "$W" .
