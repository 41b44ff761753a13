"""Offline sm_90 SASS of lce_fwd_seg_kernel (the default tile, 128x256x64, 8 warps, 3 stages): instructions per
logit for the base call, soft-cap, top-k's epilogue and selected picks. Counts are of the whole kernel divided by
the 256 logits each thread holds across its four fold instances (two unmasked, two masked halves), so they bound
the epilogue's per-logit work from above. Run from the repository root: python <this file>."""
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from areal_lce.backends.triton import segment_kernels as S

fn = S.lce_fwd_seg_kernel
INT = {"N", "H", "V", "G", "SPLIT_V", "n_splits", "stride_seg", "stride_part", "K_sel"}
PTR = {"h": "*bf16", "w": "*bf16", "d_h": "*bf16", "d_w": "*bf16", "y": "*i32", "top_col": "*i8",
       "sel_plane": "*i16", "sel_lslot": "*i32"}
bindir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
print("triton", triton.__version__)
for name, cap, top, sel in (("base", False, False, False), ("softcap", True, False, False),
                            ("top_epilogue", False, True, False), ("selected_picks", False, False, True)):
    consts = dict(HAS_INV_T=False, HAS_CACHE=False, HAS_SUMS=False, HAS_TOP=top, HAS_SEL=sel, BF16_LOGITS=True,
                  SOFTCAP=cap, EVEN_K=True, UPCAST=False, DOT_PRECISION="tf32", USE_TMA=False, SEG=128, SUB=2,
                  BLOCK_N=128, BLOCK_K=64, GROUP_N=16, CACHE_COLS=256)
    sig = {a: "constexpr" if a in consts else "i32" if a in INT else
           "fp32" if a in ("inv_t_scalar", "softcap", "inv_softcap") else PTR.get(a, "*fp32") for a in fn.arg_names}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=8, num_stages=3))
    cub = os.path.join(tempfile.mkdtemp(), "k.cubin")
    open(cub, "wb").write(k.asm["cubin"])
    sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", cub], capture_output=True, text=True).stdout
    ins = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    ops = collections.Counter(re.sub(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", ln).split(" ")[0].split(".")[0]
                              for ln in ins)
    mufu = sum(1 for ln in ins if "MUFU" in ln)
    print(f"{name:15s} instructions {len(ins)} ({len(ins) / 256:.1f} per logit), MUFU {mufu} ({mufu / 256:.2f} per "
          f"logit); " + " ".join(f"{o}:{c}" for o, c in ops.most_common(16)))
