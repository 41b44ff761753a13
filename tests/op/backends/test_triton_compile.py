"""The CUDA Triton kernels through the real Triton compiler to A100 (sm_80), H100 (sm_90) and B200 (sm_100)
binaries, offline (the ptxas bundled in the triton wheel), one subprocess per target. The interpreter tests
check values, not typing or lowering: a kernel edit that only breaks on a GPU (a loop-carried type, a store of
the wrong shape, a tile past a GPU's shared memory) fails here on a CPU-only machine.

Each kernel in _GEMM and _OTHER is compiled once per target, with every epilogue flag on (docs/backends.md,
What runs where, names the kernels left out). The GEMM kernels (forward, the backward's recompute, the
invariant forward) are built at the launcher's bf16 tiles (configs.FWD_GPU / BWD_GPU: block sizes, warps,
stages) with TMA loads, the launcher's default: its host-side `TensorDescriptor` arguments take the signature
`tensordesc<bf16[rows, cols]>` (the descriptor's block shape), which is all the compiler needs; no device is
involved. Each build must fit the target's shared memory per block (what Triton checks at launch). On sm_90
and sm_100 the descriptor loads lower to TMA (the binary's `tensordesc_meta` names each descriptor); for
sm_80, which has no TMA, Triton rewrites them into masked pointer loads, and Triton's launcher passes the
host descriptors as base pointer, shape and strides. On sm_90 and sm_100 the pointer-load path
(USE_TMA=False, taken where the layout does not allow TMA) is compiled too, with the epilogue flags off.
Every kernel builds for every target, so `backend="auto"` needs no capability fallback.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.paths import REPO

_SCRIPT = r"""
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from areal_lce.op import exact
from areal_lce.op.backends.triton import configs
from areal_lce.op.backends.triton import kernels as K
from areal_lce.op.backends.triton import segment_kernels as S
from areal_lce.op.backends.triton import candidate_kernels as C
from areal_lce.op.backends.triton import select_kernels as T
from areal_lce.op.backends.triton import output_kernels as O

ARCH, LOADS = int(sys.argv[1]), sys.argv[2].split(",")
SMEM = {80: 166912, 90: 232448, 100: 232448}[ARCH]  # shared memory per block with opt-in: A100, H100, B200
INT = {"N", "H", "V", "G", "K", "C", "R", "CAP", "KK", "K1", "K2", "K_sel", "SPLIT_V", "n_splits", "stride_part",
       "stride_seg", "v_begin", "width", "stride_dl", "n_programs", "n_prog", "vocab_start", "shard_valid", "valid",
       "ignore_index"}
FP = {"inv_t_scalar", "softcap", "inv_softcap"}
TYPES = {"h": "*bf16", "w": "*bf16", "d_h": "*bf16", "d_w": "*bf16", "dl": "*bf16", "y": "*i32", "y_ptr": "*i64",
         "out_ptr": "*i32", "top_col": "*i8", "flags": "*i8", "best": "*i64", "cand": "*i64", "seg_count": "*i32",
         "seg_list": "*i32", "task_seg": "*i32", "task_first": "*i32", "n_tasks": "*i32", "count": "*i32",
         "sel_plane": "*i16", "sel_lslot": "*i32", "ids": "*i64", "plane": "*i16", "lslot": "*i32", "src": "*i64",
         "pairs": "*i64", "sel": "*i64", "top": "*i64", "cols": "*i64", "pad": "i64"}


def compile_(fn, consts, tile=None, boxes=None, **types):
    # args typed from the tables (types overrides), d_h / d_w as TMA descriptors of the given [rows, cols] boxes
    # when USE_TMA, the launcher's warps and stages when tile is given
    sig = {a: "constexpr" if a in consts else types.get(a) or ("i32" if a in INT else "fp32" if a in FP
           else TYPES.get(a, "*fp32")) for a in fn.arg_names}
    if consts.get("USE_TMA"):
        sig.update({a: f"tensordesc<bf16[{r}, {c}]>" for a, (r, c) in zip(("d_h", "d_w"), boxes)})
    opts = {"num_warps": tile.num_warps, "num_stages": tile.num_stages} if tile is not None else {}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", ARCH, 32),
                       options=opts)
    assert "cubin" in k.asm, fn.__name__
    assert k.metadata.shared <= SMEM, f"{fn.__name__}: {k.metadata.shared} B of shared memory > sm_{ARCH}'s {SMEM}"
    tma = len(k.metadata.tensordesc_meta or ()) if consts.get("USE_TMA") else "off"
    print("compiled", fn.__name__, f"tma={tma}", f"shared={k.metadata.shared}", flush=True)


fwd, bwd = configs.FWD_GPU, configs.BWD_GPU
common = dict(EVEN_K=True, UPCAST=False, DOT_PRECISION="tf32", CACHE_COLS=configs.CACHE_COLS)
for tma in (load == "tma" for load in LOADS):
    on = tma  # every epilogue with TMA loads, none with pointer loads
    fwd_boxes = ((fwd.block_n, fwd.block_k), (fwd.block_v, fwd.block_k))
    tiles = dict(common, USE_TMA=tma, BLOCK_N=fwd.block_n, BLOCK_V=fwd.block_v, BLOCK_K=fwd.block_k,
                 GROUP_N=fwd.group_n)
    compile_(K.lce_fwd_kernel, dict(tiles, HAS_INV_T=on, HAS_CACHE=False, HAS_SUMS=on, BF16_LOGITS=on, SOFTCAP=on),
             fwd, fwd_boxes)
    compile_(K.lce_fwd_merge_kernel, dict(HAS_SUMS=on, BLOCK_N=configs.MERGE_BLOCK_N))
    tiles = dict(common, USE_TMA=tma, BLOCK_N=bwd.block_n, BLOCK_V=bwd.block_v, BLOCK_K=bwd.block_k,
                 GROUP_N=bwd.group_n)
    compile_(K.lce_bwd_kernel, dict(tiles, HAS_INV_T=on, USE_CACHE=False, BF16_LOGITS=on, SOFTCAP=on),
             bwd, ((bwd.block_n, bwd.block_k), (bwd.block_v, bwd.block_k)))
    # the invariant forward with every epilogue (top-k maxima, selected ids' picks, soft-cap): 128-column
    # segments, two per tile, the weight's descriptor one segment wide (segment_launch.py)
    tiles = dict(common, USE_TMA=tma, BLOCK_N=fwd.block_n, BLOCK_K=fwd.block_k, GROUP_N=fwd.group_n)
    compile_(S.lce_fwd_seg_kernel, dict(tiles, HAS_INV_T=on, HAS_CACHE=False, HAS_SUMS=False, HAS_TOP=on, HAS_SEL=on,
                                        BF16_LOGITS=False, SOFTCAP=on, SEG=exact.SEG, SUB=fwd.block_v // exact.SEG),
             fwd, ((fwd.block_n, fwd.block_k), (exact.SEG, fwd.block_k)))
compile_(K.lce_bwd_label_kernel, dict(HAS_INV_T=True, BLOCK_N=configs.LABEL_FIX_BLOCK_N))
compile_(K.local_labels_kernel, dict(BLOCK=configs.LOCAL_LABELS_BLOCK))
# the top-k's own kernels: the ranking with its candidate plan (atomics, a data-dependent loop), the listed
# recompute (a persistent loop over a device-held count, tensor-core tiles), the maxima's transpose
compile_(T.segment_best_kernel, dict(HAS_INV_T=True, PLAN=True, HAS_TOP=True, BLOCK_N=1, CHUNK=256, KK2=64))
compile_(C.listed_candidates_kernel, dict(SEG=exact.SEG, BLOCK_N=64, BLOCK_K=64, EVEN_K=True, UPCAST=False,
                                           DOT_PRECISION="tf32", HAS_INV_T=False, BF16_LOGITS=True, SOFTCAP=True))
compile_(S.transpose_kernel, dict(BLOCK_R=64, BLOCK_C=64))
# the selected ids' pick plan and the listed pairs' dot products (a persistent loop over a device-held count)
compile_(T.selected_plan_kernel, dict(SEG=exact.SEG, BLOCK_R=2, KP=64))
compile_(T.pair_logits_kernel, dict(BLOCK_P=16, BLOCK_H=64), count="*i64")
# the backward's sparse columns in one launch (both id sets, per-token 1/T, lse's gradient)
compile_(O.sparse_coef_kernel, dict(HAS_INV_T=True, HAS_LSE=True, HAS_SEL=True, HAS_TOP=True, BLOCK_R=16, BLOCK_K=64),
         y="*i64")
"""

_GEMM = ("lce_fwd_kernel", "lce_bwd_kernel", "lce_fwd_seg_kernel")  # the kernels that take TMA descriptors
_OTHER = ("lce_fwd_merge_kernel", "lce_bwd_label_kernel", "local_labels_kernel", "segment_best_kernel",
          "listed_candidates_kernel", "transpose_kernel", "selected_plan_kernel", "pair_logits_kernel",
          "sparse_coef_kernel")
# sm_80 has no TMA: its descriptor build is a pointer-load build already (module docstring)
_LOADS = {80: ("tma",), 90: ("tma", "pointer"), 100: ("tma", "pointer")}


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(_LOADS), ids=lambda a: f"sm{a}")
def test_cuda_kernels_compile_for_each_target(arch, tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")  # absent where triton-ascend replaces triton
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = str(REPO)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(arch), ",".join(_LOADS[arch])], env=env, cwd=root,
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and "ptxas" in r.stderr and "No such file" in r.stderr:
        pytest.skip("this triton install has no bundled ptxas")
    assert r.returncode == 0, r.stderr[-3000:]
    built = [line.split()[1:3] for line in r.stdout.splitlines() if line.startswith("compiled")]
    # TMA on sm_90 / sm_100: both descriptors lowered to TMA; on sm_80 rewritten to pointer loads (none left)
    tma = "tma=0" if arch < 90 else "tma=2"
    want = [[k, tma] for k in _GEMM] + [[k, "tma=off"] for k in _GEMM] * ("pointer" in _LOADS[arch])
    assert sorted(b for b in built if b[0] in _GEMM) == sorted(want), r.stdout
    assert sorted({b[0] for b in built} - set(_GEMM)) == sorted(_OTHER), r.stdout
