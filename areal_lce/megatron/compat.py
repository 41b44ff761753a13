"""Version detection and the CPU shims megatron-core needs to run without CUDA.

Everything that depends on *which* megatron-core is installed lives here, so the capture seam, the
model builder and the engine ask one place: `has_output_processor()` says whether
`GPTModel.forward(output_processor=...)` exists (megatron-core >= 0.18; of another model class when
given one), `language_model_classes()` names the models the seam accepts (GPTModel, and HybridModel from
0.19), `quiet_gpt_deprecation()` drops 0.19's GPTModel deprecation notice where the engine builds its
GPTModel, `megatron_version()` gives the installed version, `check_linear_cross_entropy` refuses the one seam that megatron-core's own fused
linear cross entropy (an output layer of another class) would break. `use_device_grad_norm()` replaces megatron's host-syncing fallback L2 norm
(no Apex / Transformer Engine) in its gradient clipping with a device-side one, until
`restore_device_grad_norm()`. `cpu_shims()` is a
context manager that makes the CUDA-only calls megatron-core makes while building, running and
training a model harmless on a CPU-only host, and restores everything on exit; it is a no-op when CUDA is available. The engine enters it around its own
megatron calls; code that drives a megatron model itself on CPU (tests, examples) enters it too.
Every replacement goes through `areal_lce.patching` (reversible, refused when the target moved).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import List, Tuple

import torch

from .. import patching


@functools.lru_cache(maxsize=None)
def megatron_version() -> Tuple[int, ...]:
    """(major, minor, patch) of the installed megatron-core."""
    try:
        from importlib.metadata import version

        text = version("megatron-core")
    except Exception:  # editable / vendored installs without metadata
        from megatron.core import package_info

        text = package_info.__version__
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@functools.lru_cache(maxsize=None)
def has_output_processor(model_class=None) -> bool:
    """True when `model_class.forward` (GPTModel's when None) accepts `output_processor=` (GPTModel of
    megatron-core >= 0.18; HybridModel has no such argument)."""
    if model_class is None:
        from megatron.core.models.gpt.gpt_model import GPTModel

        model_class = GPTModel
    return "output_processor" in inspect.signature(model_class.forward).parameters


def hybrid_model_class():
    """megatron-core's HybridModel (0.19+, the successor of GPTModel and MambaModel), or None before it."""
    try:
        from megatron.core.models.hybrid.hybrid_model import HybridModel
    except ImportError:
        return None
    return HybridModel


def language_model_classes() -> Tuple[type, ...]:
    """The megatron-core language models whose LM head the capture seam replaces: GPTModel, and
    HybridModel where installed (MambaModel, its deprecated subclass, included)."""
    from megatron.core.models.gpt import GPTModel

    hybrid = hybrid_model_class()
    return (GPTModel,) if hybrid is None else (GPTModel, hybrid)


_GPT_DEPRECATION = "GPTModel IS DEPRECATED"  # megatron-core 0.19's notice at every GPTModel construction


class _DropGptDeprecation(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_GPT_DEPRECATION)


@contextlib.contextmanager
def quiet_gpt_deprecation():
    """Within the block, megatron-core 0.19's "GPTModel IS DEPRECATED ... HybridModel" notice (logged by
    its gpt_model module at every construction) is dropped; every other record of that logger passes.
    The engine builds a GPTModel on purpose (docs/megatron.md, "HybridModel"), so the notice only tells
    its users of a migration that is not theirs to make."""
    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    drop = _DropGptDeprecation()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def check_linear_cross_entropy(config, seam: str) -> None:
    """megatron-core's own fused linear cross entropy (`cross_entropy_loss_fusion` with
    `cross_entropy_fusion_impl="linear"`: megatron-core's development branch at the time of writing,
    Blackwell only) makes GPTModel's output layer a `LinearCrossEntropyModule`, a ColumnParallelLinear
    whose forward also takes the labels. The output_processor seam runs in its place, as for any output
    layer (its plain forward gives the logits: the materialised route; MTP heads keep megatron's own
    loss); the output_layer seam's instance forward does not take those labels: refused, naming both."""
    linear = getattr(config, "cross_entropy_loss_fusion", False) and \
        getattr(config, "cross_entropy_fusion_impl", None) == "linear"
    if linear and seam == "output_layer":
        raise ValueError("cross_entropy_loss_fusion with cross_entropy_fusion_impl='linear' (megatron-core's fused "
                         "linear cross entropy: the output layer is a LinearCrossEntropyModule, whose forward takes the "
                         "labels) with capture_seam='output_layer', which replaces that forward: use "
                         "capture_seam='output_processor' or 'auto' (every megatron-core with the linear "
                         "implementation has it)")


def _l2_norm_on_device(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Stand-in for megatron-core's local `multi_tensor_l2norm` (its fallback without Apex or Transformer
    Engine), same call and result: the L2 norm of all tensors as a [1] fp32 tensor, and None. Computed on
    the device by torch's `get_total_norm` (grouped foreach norms), where the fallback reads every
    per-tensor norm on the host: one device sync per parameter tensor, every optimizer step."""
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=torch.cuda.current_device()), None
    return torch.nn.utils.get_total_norm(tensors, 2.0).float().reshape(1), None


_grad_norm_patch = None  # the areal_lce.patching handle of use_device_grad_norm, None when not applied


def use_device_grad_norm() -> bool:
    """Point megatron-core's gradient clipping at `_l2_norm_on_device` when it fell back to its local L2
    norm (Apex's or Transformer Engine's kernel, when installed, is left alone), until
    `restore_device_grad_norm()`. Idempotent; True when the device-side norm is in use."""
    global _grad_norm_patch
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is getattr(utils, "local_multi_tensor_l2_norm", None):
        previous, _grad_norm_patch = _grad_norm_patch, patching.apply(
            patching.Patch(clip_grads, "l2_norm_impl", _l2_norm_on_device))
        if previous is not None:  # the fallback was put back by something else since: the new patch replaces it
            previous.restore()
    return clip_grads.l2_norm_impl is _l2_norm_on_device


def restore_device_grad_norm() -> bool:
    """Undo `use_device_grad_norm`: megatron's own fallback norm is back. False when it was not in use."""
    global _grad_norm_patch
    handle, _grad_norm_patch = _grad_norm_patch, None
    return handle is not None and handle.restore()


class _NullStream:
    """Stand-in for torch.cuda.current_stream() on CPU: nothing to wait for."""

    def wait_event(self, event) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None

    def synchronize(self) -> None:
        return None


class _CpuTorch:
    """`torch` for megatron's schedules module on a CPU-only host: device="cuda" -> "cpu"."""

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in ("zeros", "ones", "empty", "full", "tensor"):
            def factory(*args, **kwargs):
                if str(kwargs.get("device", "")).startswith("cuda"):
                    kwargs["device"] = "cpu"
                return attr(*args, **kwargs)
            return factory
        return attr


def _pos_emb_on_this_cp_rank_cpu(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """megatron's get_pos_emb_on_this_cp_rank without pinned memory: chunks r and 2cp-1-r of 2cp."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp, rank = cp_group.size(), cp_group.rank()
    chunks = pos_emb.chunk(2 * cp, dim=seq_dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=seq_dim)


def _shim_targets() -> List[Tuple[object, str, object]]:
    """(owner, attribute, stand-in) of every replacement, with why each is needed on a CPU-only host:

    * `torch.cuda.current_device()` is asked for the device of new tensors by megatron's DDP grad
      buffers, RoPE's frequency table (every forward), the tensor-parallel mappings' gather /
      reduce-scatter buffers (forward and backward), pipeline p2p receive buffers and the inference
      context's KV buffers: answer the CPU device instead of raising.
    * `torch.cuda.current_stream()` is asked for by DDP's grad sync (`finalize_model_grads`) before it
      waits on CUDA-graph events: answer a stream that has nothing to wait for.
    * `torch.cuda.synchronize()` (pipeline p2p) is a no-op: CPU collectives complete on wait().
    * `Tensor.cuda()` returns the tensor itself: GPTModel moves the last pipeline stage's copy of tied
      embeddings to CUDA before all-reducing it with the first stage's.
    * megatron's pipeline schedules module gets a `torch` whose tensor factories map device="cuda" to
      the CPU (its token counter is allocated with a hard-coded device).
    * RoPE under context parallelism (BSHD) selects this rank's zigzag chunks of the position table
      with a pinned-memory index moved to CUDA: the same selection without pinning or CUDA.
    Parallel-state set-up and seeding need none (`parallel.init_distributed` creates the RNG tracker
    with `inference_rng_tracker=True`, which keeps it off CUDA generator states).
    """
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding
    from megatron.core.pipeline_parallel import schedules

    targets = [(torch.cuda, "current_device", lambda: torch.device("cpu")),
               (torch.cuda, "current_stream", lambda *a, **k: _NullStream()),
               (torch.cuda, "synchronize", lambda *a, **k: None),
               (torch.Tensor, "cuda", lambda self, *a, **k: self),
               (schedules, "torch", _CpuTorch())]
    rope_modules = [rope_utils, rotary_pos_embedding]
    try:
        from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding

        rope_modules.append(yarn_rotary_pos_embedding)
    except ImportError:
        pass
    targets += [(m, "get_pos_emb_on_this_cp_rank", _pos_emb_on_this_cp_rank_cpu) for m in rope_modules]
    return targets


_depth = 0  # nesting depth of cpu_shims() (the engine's train_step calls its token_stats, ...)
_shims = None  # the areal_lce.patching handle of the outermost cpu_shims()


def shims_active() -> bool:
    """True inside `cpu_shims()` on a host without CUDA (megatron-core's CUDA calls are shimmed)."""
    return _depth > 0


@contextlib.contextmanager
def cpu_shims():
    """Within the block, megatron-core runs on a host without CUDA (`_shim_targets` lists what is replaced
    and why); the originals are back on exit, also on error (areal_lce.patching). Re-entrant; a no-op
    when CUDA is available. Usable as a decorator (`@cpu_shims()`)."""
    global _depth, _shims
    if torch.cuda.is_available():
        yield
        return
    if _depth == 0:
        _shims = patching.apply(*(patching.Patch(*target) for target in _shim_targets()))
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            handle, _shims = _shims, None
            handle.restore()
