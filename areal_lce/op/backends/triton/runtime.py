"""What the Triton backend's launchers share (launch.py, segment_launch.py, select_launch.py,
output_launch.py): the interpreter flag, the device context, SM slots, TMA descriptors, launch options,
the dot precision and softcap's kernel arguments. Every buffer a kernel writes comes from base.alloc
(NaN-filled under the tests)."""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
from typing import Tuple

import torch

from .... import patching
from ...types import LCEParams
from . import configs

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: pointer loads only
    TensorDescriptor = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _scalar_index(self) -> int:
    return int(self.handle.data.reshape(-1)[0]) if self.handle.data.size == 1 else int(self.handle.data)


def interpreter_scalar_index() -> None:
    """Under TRITON_INTERPRET=1 with triton < 3.7: a loop whose bound is a tensor (`range(n_tiles)`) works.

    The interpreter holds a scalar as a 1-element array; triton 3.6's `tensor.__index__` is `int(array)`,
    which NumPy >= 2.3 refuses for a 1-d array ("only 0-dimensional arrays can be converted to Python
    scalars"), so every kernel with such a loop failed there. Triton 3.7 squeezes the array first; this
    gives the older interpreter the same conversion, on the tensor methods it installs for each kernel run
    (its own `_patch_lang_tensor`, wrapped once through areal_lce.patching; 3.7's is left as it is). Nothing
    changes where the compiled kernels run."""
    from triton.runtime import interpreter

    installer = interpreter._patch_lang_tensor
    try:
        squeezes = "squeeze" in inspect.getsource(installer)
    except (OSError, TypeError):  # no source shipped: wrap it (the same conversion where it squeezes already)
        squeezes = False
    if getattr(installer, "_areal_lce_scalar_index", False) or squeezes:
        return

    def install(tensor, scope):
        installer(tensor, scope)
        scope.set_attr(tensor, "__index__", _scalar_index)

    install._areal_lce_scalar_index = True
    patching.apply(patching.Patch(interpreter, "_patch_lang_tensor", install))


if INTERPRET:
    interpreter_scalar_index()


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_slots(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 1


def device_ctx(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def descriptors(hidden, weight_valid, cfg):
    """TMA descriptors of hidden [N, H] and the shard's valid weight rows, or (None, None) when the
    layout does not allow them (TMA needs 16-byte aligned bases and row strides) or they are off."""
    if not configs.USE_TMA or TensorDescriptor is None:
        return None, None
    for t in (hidden, weight_valid):
        if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16 or t.stride(1) != 1:
            return None, None
    return (TensorDescriptor.from_tensor(hidden, [cfg.block_n, cfg.block_k]),
            TensorDescriptor.from_tensor(weight_valid, [cfg.block_v, cfg.block_k]))


def launch_opts(cfg) -> dict:
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.maxnreg and not INTERPRET:
        opts["maxnreg"] = cfg.maxnreg
    return opts


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must give IEEE fp32 logits (TF32 would cost ~1e-3 relative); the interpreter computes
    # exact fp32 dots for any precision name.
    return "ieee" if (dtype == torch.float32 or INTERPRET) else "tf32"


def cap_args(params: LCEParams) -> Tuple[float, float]:
    """(softcap, 1 / softcap) for the kernels' SOFTCAP path; (0, 0) unused when off. One 1 / softcap for the
    forward and the backward's recompute, so both cap each logit to the same bits."""
    c = float(params.softcap)
    return (c, 1.0 / c) if c else (0.0, 0.0)
