import os, sys, time, warnings; warnings.filterwarnings("ignore")
import torch
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, os.getcwd())
from benchmark.bench_packing import make_steps, build, sft_step
import argparse
OUT = os.environ.get("OUT", "/tmp")
args = argparse.Namespace(preset="qwen2.5-0.5b", seqs=8, micro_batch=4, prompt_len=64, min_response=64, max_response=2048, steps=3)
def summarize(p, name):
    ka = p.key_averages()
    with open(f"{OUT}/prof_{name}.txt", "w") as f:
        f.write(ka.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70))
        f.write(ka.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
    rows = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:10]
    print(f"--- {name}: top self-CPU")
    for e in rows:
        print(f"  {e.key[:60]:60s} n={e.count:6d} cpu={e.self_cpu_time_total/1e3:8.1f}ms")
    rows = sorted(ka, key=lambda e: -getattr(e, "self_device_time_total", 0))[:8]
    print(f"--- {name}: top self-CUDA")
    for e in rows:
        print(f"  {e.key[:60]:60s} n={e.count:6d} cuda={getattr(e,'self_device_time_total',0)/1e3:8.1f}ms")
for fused, pack in ((True, True), (True, False), (False, False)):
    steps = make_steps(args, 151936)
    eng = build(args, fused, pack)
    sft_step(eng, steps[0], None, None); torch.cuda.synchronize()
    t0 = time.perf_counter(); sft_step(eng, steps[1], None, None); torch.cuda.synchronize(); t1 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        sft_step(eng, steps[2], None, None); torch.cuda.synchronize()
    print(f"=== fused={fused} pack={pack}: step {1e3*(t1-t0):.0f} ms")
    summarize(p, f"sft_f{int(fused)}_p{int(pack)}")
    del eng; torch.cuda.empty_cache()
# rollout decode
from areal_lce.megatron.config import EngineConfig, ModelConfig
from areal_lce.megatron.engine import MegatronEngine
eng = MegatronEngine(EngineConfig(model=ModelConfig(preset="qwen2.5-0.5b", max_seq_len=512)))
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 1000, (100,), generator=g).tolist() for _ in range(64)]
eng.generate(prompts, 4); torch.cuda.synchronize()
t0 = time.perf_counter(); eng.generate(prompts, 32); torch.cuda.synchronize(); t1 = time.perf_counter()
print(f"=== rollout 64 x 32: {1e3*(t1-t0)/32:.1f} ms/token")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    eng.generate(prompts, 16); torch.cuda.synchronize()
summarize(p, "rollout")
