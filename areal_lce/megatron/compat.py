"""Version detection and the CPU shims megatron-core needs to run without CUDA.

Everything that depends on *which* megatron-core is installed lives here, so the capture seam, the
model builder and the engine ask one place: `has_output_processor()` says whether
`GPTModel.forward(output_processor=...)` exists (megatron-core >= 0.18), `megatron_version()` gives
the installed version. `apply_cpu_shims()` makes the few CUDA-only calls megatron-core makes during
model construction and seeding harmless on a CPU-only host; it is idempotent and a no-op when CUDA
is available.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Tuple

import torch


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
def has_output_processor() -> bool:
    """True when GPTModel.forward accepts `output_processor=` (megatron-core >= 0.18)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    return "output_processor" in inspect.signature(GPTModel.forward).parameters


_SHIMS_APPLIED = False


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


def apply_cpu_shims() -> None:
    """Let megatron-core build and seed models on a host without CUDA.

    * `torch.cuda.current_device()` is called while allocating parameters and DDP buffers: answer
      the CPU device instead of raising.
    * `torch.cuda.current_stream()` is asked for by DDP's grad sync before it waits on CUDA-graph
      events: answer a stream that has nothing to wait for.
    * `torch.cuda.synchronize()` (pipeline p2p) is a no-op: CPU collectives complete on wait().
    * megatron's pipeline schedules module gets a `torch` whose tensor factories map device="cuda"
      to the CPU (its token counter is allocated with a hard-coded device).
    * RoPE under context parallelism (BSHD) selects this rank's zigzag chunks of the position table
      with a pinned-memory index moved to CUDA: the same selection without pinning or CUDA.
    * `torch.cuda.manual_seed` / RNG state getters are harmless no-ops without CUDA already; the
      RNG tracker is created with `inference_rng_tracker=True` by `parallel.init_distributed`, which
      keeps it off CUDA generator states.
    """
    global _SHIMS_APPLIED
    if _SHIMS_APPLIED or torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    # DDP's grad sync asks for the current stream to wait on CUDA-graph events (none exist here).
    torch.cuda.current_stream = lambda *a, **k: _NullStream()  # type: ignore[assignment]
    # Pipeline p2p guards batch_isend_irecv with a device synchronize; CPU ops are synchronous.
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    # The pipeline schedules allocate their token counter with device="cuda": give that module a
    # torch whose factory functions map "cuda" to the CPU (everything else is the real torch).
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _CpuTorch()
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    modules = [rope_utils, rotary_pos_embedding]
    try:
        from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding

        modules.append(yarn_rotary_pos_embedding)
    except ImportError:
        pass
    for module in modules:
        module.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank_cpu
    _SHIMS_APPLIED = True


def _pos_emb_on_this_cp_rank_cpu(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """megatron's get_pos_emb_on_this_cp_rank without pinned memory: chunks r and 2cp-1-r of 2cp."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp, rank = cp_group.size(), cp_group.rank()
    chunks = pos_emb.chunk(2 * cp, dim=seq_dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=seq_dim)


def on_cpu() -> bool:
    return not torch.cuda.is_available()


@contextlib.contextmanager
def tensor_cuda_is_identity():
    """While building a model on a CPU-only host, `Tensor.cuda()` returns the tensor itself.

    GPTModel moves the last pipeline stage's copy of tied embeddings to CUDA before all-reducing it
    with the first stage's; on CPU the copy stays where it is. Restored on exit; no-op with CUDA.
    """
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]
