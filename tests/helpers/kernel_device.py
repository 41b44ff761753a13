"""Where a test session runs the Triton kernels: one decision per process, made by tests/conftest.py before
anything imports triton (a kernel is compiled or interpreted as TRITON_INTERPRET reads when its module is
imported, so the choice cannot change inside a process).

    a CUDA device, TRITON_INTERPRET unset or 0   the compiled kernels on CUDA tensors: kernel_device() is cuda
    no CUDA device, TRITON_INTERPRET unset       conftest sets TRITON_INTERPRET=1: the interpreter on CPU
                                                 tensors, kernel_device() is cpu
    TRITON_INTERPRET=1 set by hand               the interpreter on CPU tensors, GPU or not; the `gpu` tests
                                                 are skipped (their Triton kernels would be interpreted)
    TRITON_INTERPRET=0 set by hand, no CUDA      no kernel device (None): the kernel tests are skipped

A test that runs a Triton kernel puts its tensors on `kernel_device()` (through `on_kernel_device`) and
brings what it compares back to the CPU; a case only the interpreter can run (the Ascend kernels on CPU
tensors, an interpreter-only knob) asks `interpreter_on()` and is skipped with `needs_interpreter`.
Subprocesses that import triton get the variable from this process's environment (torchrun workers
inherit it) or set it themselves before their first triton import.
"""
from __future__ import annotations

import os
from typing import Optional

import pytest
import torch

ENV = "TRITON_INTERPRET"


def interpreter_on() -> bool:
    """Whether this process interprets the Triton kernels (on CPU tensors)."""
    return os.environ.get(ENV, "0") not in ("", "0")


def choose_interpreter() -> None:
    """The interpreter where there is no CUDA device, unless the variable is set already (an explicit 0 keeps
    the kernels off a CPU-only host). Run when this module is imported: tests/conftest.py imports it first."""
    if ENV not in os.environ and not torch.cuda.is_available():
        os.environ[ENV] = "1"


choose_interpreter()  # on import: conftest imports this module first, before anything imports triton


def kernel_device() -> Optional[torch.device]:
    """The device whose tensors the Triton kernels take in this process: cpu under the interpreter, cuda with
    a CUDA device and the compiled kernels, None where neither."""
    if interpreter_on():
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    return None


def on_kernel_device(*tensors):
    """The tensors (None kept) moved to kernel_device(); the test is skipped where there is none."""
    dev = kernel_device()
    if dev is None:
        pytest.skip(f"no device runs the Triton kernels here: no CUDA device and {ENV}=0")
    moved = tuple(None if t is None else t.to(dev) for t in tensors)
    return moved[0] if len(moved) == 1 else moved


needs_interpreter = pytest.mark.skipif(
    not interpreter_on(), reason=f"runs the Triton kernels on CPU tensors: only under {ENV}=1 (a CPU host's default)")
needs_kernels = pytest.mark.skipif(
    kernel_device() is None, reason=f"no device runs the Triton kernels here: no CUDA device and {ENV}=0")
