"""The Triton interpreter (TRITON_INTERPRET=1, how a CPU host runs the kernels) on the triton versions in use:
a loop bounded by a tensor, as every forward kernel has (`range(n_tiles)`), runs on triton 3.6's
interpreter with NumPy >= 2.3 as on 3.7's (runtime.interpreter_scalar_index)."""
import types

import numpy as np
import pytest
import torch

from helpers.kernel_device import needs_interpreter
from areal_lce.op.backends.triton import runtime


def test_scalar_index_takes_the_interpreters_scalar_forms():
    for data, want in ((np.array([7]), 7), (np.array(7), 7), (np.array([[3]]), 3)):
        assert runtime._scalar_index(types.SimpleNamespace(handle=types.SimpleNamespace(data=data))) == want
    with pytest.raises(TypeError):  # a block is not an index, as in triton itself
        runtime._scalar_index(types.SimpleNamespace(handle=types.SimpleNamespace(data=np.array([1, 2]))))


@needs_interpreter
def test_a_loop_bounded_by_a_tensor_runs_interpreted():
    import triton
    import triton.language as tl

    @triton.jit
    def count_tiles(y, out, V, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        i_s = tl.program_id(0)
        b = tl.load(y + tl.arange(0, BLOCK))
        v_begin = i_s * SPLIT
        v_end = tl.minimum(v_begin + SPLIT, V)
        v_end = tl.where(tl.max((b != -100).to(tl.int32), 0) > 0, v_end, v_begin)
        acc = 0
        for _ in range(0, (v_end - v_begin) // 16):
            acc += 1
        tl.store(out + i_s, acc)

    y = torch.zeros(16, dtype=torch.int64)
    out = torch.full((3,), -1, dtype=torch.int64)
    count_tiles[(3,)](y, out, 100, SPLIT=48, BLOCK=16)
    assert out.tolist() == [3, 3, 0]  # columns [0, 48), [48, 96), [96, 100): 48 // 16, 48 // 16, 4 // 16
    y.fill_(-100)  # every row ignored: no tile
    count_tiles[(3,)](y, out, 100, SPLIT=48, BLOCK=16)
    assert out.tolist() == [0, 0, 0]
