"""The CUDA Triton kernels through the real Triton compiler to an sm_90 binary, offline (the ptxas bundled
in the triton wheel). The interpreter tests check values, not typing or lowering: a kernel edit that only
breaks on a GPU (a loop-carried type, a store of the wrong shape) fails here on a CPU-only machine.
Pointer-load path (USE_TMA=False): the TMA descriptors are built on a device."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.paths import REPO

_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from areal_lce.backends.triton import kernels as K
from areal_lce.backends.triton import segment_kernels as S
from areal_lce.backends.triton import candidate_kernels as C
from areal_lce.backends.triton import select_kernels as T

PTR = {"h": "*bf16", "w": "*bf16", "d_h": "*bf16", "d_w": "*bf16", "y": "*i32", "dl": "*bf16", "y_ptr": "*i64",
       "out_ptr": "*i32"}
INT = {"N", "H", "V", "SPLIT_V", "n_splits", "stride_part", "v_begin", "width", "stride_dl", "n_programs",
       "vocab_start", "shard_valid", "ignore_index"}


def compile_(fn, consts):
    sig = {a: "constexpr" if a in consts else "i32" if a in INT else "fp32" if a in ("inv_t_scalar", "softcap", "inv_softcap")
           else PTR.get(a, "*fp32") for a in fn.arg_names}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
    assert "cubin" in k.asm, fn.__name__
    print("compiled", fn.__name__, sorted(k for k, v in consts.items() if v is True))


tiles = dict(EVEN_K=True, UPCAST=False, DOT_PRECISION="tf32", USE_TMA=False, BLOCK_N=128, BLOCK_V=128,
             BLOCK_K=64, GROUP_N=8, CACHE_COLS=0)
for sums, per_token in ((False, False), (True, True)):
    compile_(K.lce_fwd_kernel, dict(tiles, HAS_INV_T=per_token, HAS_CACHE=False, HAS_SUMS=sums, SOFTCAP=sums))
    compile_(K.lce_fwd_merge_kernel, dict(HAS_SUMS=sums, BLOCK_N=128))
    compile_(K.lce_bwd_kernel, dict(tiles, HAS_INV_T=per_token, USE_CACHE=False, SOFTCAP=sums))
compile_(K.local_labels_kernel, dict(BLOCK=1024))
# the top-k's own kernels: the ranking with its candidate plan (atomics, a data-dependent loop), the listed
# recompute (a persistent loop over a device-held count, tensor-core tiles), the maxima's transpose
SEL = {"seg": "*fp32", "top_col": "*i8", "flags": "*i8", "best": "*i64", "cand": "*i64", "seg_count": "*i32",
       "seg_list": "*i32", "task_seg": "*i32", "task_first": "*i32", "n_tasks": "*i32", "count": "*i32",
       "pad": "i64", "G": "i32", "KK": "i32", "CAP": "i32", "R": "i32", "C": "i32"}
PTR.update(SEL)
INT.update(k for k, v in SEL.items() if v[0] == "i")
for top in (True, False):  # the plan with the forward's max columns, or every chosen segment listed
    compile_(T.segment_best_kernel, dict(HAS_INV_T=True, PLAN=True, HAS_TOP=top, BLOCK_N=1, CHUNK=256, KK2=64))
INT.update(("valid", "n_prog"))
compile_(C.listed_candidates_kernel, dict(SEG=128, BLOCK_N=64, BLOCK_K=64, EVEN_K=True, UPCAST=False,
                                           DOT_PRECISION="tf32", HAS_INV_T=False, BF16_LOGITS=True, SOFTCAP=True))
compile_(S.transpose_kernel, dict(BLOCK_R=64, BLOCK_C=64))
# the invariant forward with every epilogue (top-k maxima, selected ids' picks, soft-cap), the pick plan and the
# listed pairs' dot products (a persistent loop over a device-held count)
PTR.update({"sel_plane": "*i16", "sel_lslot": "*i32", "ids": "*i64", "plane": "*i16", "lslot": "*i32", "src": "*i64"})
INT.update(("stride_seg", "K_sel", "K", "vocab_start", "valid", "ignore_index"))
seg_tiles = {k: v for k, v in tiles.items() if k != "BLOCK_V"}
compile_(S.lce_fwd_seg_kernel, dict(seg_tiles, HAS_INV_T=True, HAS_CACHE=False, HAS_SUMS=False, HAS_TOP=True,
                                    HAS_SEL=True, BF16_LOGITS=False, SOFTCAP=True, SEG=128, SUB=2))
compile_(T.selected_plan_kernel, dict(SEG=128, BLOCK_R=2, KP=64))
PTR.update({"pairs": "*i64", "count": "*i64"})
compile_(T.pair_logits_kernel, dict(BLOCK_P=16, BLOCK_H=64))
# the backward's sparse columns in one launch (both id sets, per-token 1/T, lse's gradient)
from areal_lce.backends.triton import output_kernels as O
PTR.update({"y": "*i64", "sel": "*i64", "top": "*i64", "cols": "*i64"})
INT.update(("K1", "K2"))
compile_(O.sparse_coef_kernel, dict(HAS_INV_T=True, HAS_LSE=True, HAS_SEL=True, HAS_TOP=True, BLOCK_R=16, BLOCK_K=64))
"""


@pytest.mark.slow
def test_cuda_kernels_compile_for_sm90(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")  # absent where triton-ascend replaces triton
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = str(REPO)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "ptxas" in r.stderr and "No such file" in r.stderr:
        pytest.skip("this triton install has no bundled ptxas")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("compiled") == 15, r.stdout
