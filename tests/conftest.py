"""Test-wide setup, done here first, before any test module imports areal_lce or triton:

* On a host with a CUDA device, two sessions (helpers/gpu_host.py, imported first): this one with CUDA
  hidden, every test as on a CPU-only host, and the `gpu` tests in a child session that sees the GPU
  (tests/test_gpu_session.py).
* Where the Triton kernels run (helpers/kernel_device.py, imported next): with a CUDA device, compiled on
  CUDA tensors; without one, through the interpreter on CPU tensors (TRITON_INTERPRET=1, which must be set
  before any @triton.jit function is defined). Kernel tests put their tensors on `kernel_device()`.
* NaN poisoning: every buffer a backend's kernels write (areal_lce.op.backends.base.alloc) starts as NaN
  (AREAL_LCE_POISON_OUTPUTS=1, read once when areal_lce.op.backends loads), so an output element a kernel
  fails to write fails the test that reads it. torchrun workers launched by the tests inherit it.
* Under the interpreter, numpy's inf/NaN RuntimeWarnings from inside it are hidden (the poisoned
  buffers make them on purpose); every other warning is shown.
* Markers (pyproject.toml): `gpu` tests are skipped without CUDA, and under TRITON_INTERPRET=1 (their
  Triton kernels would be interpreted); a test that launches several ranks through helpers.launch.torchrun
  must carry `distributed` (the launcher refuses otherwise).
"""
import os

os.environ.setdefault("AREAL_LCE_POISON_OUTPUTS", "1")

from helpers import gpu_host  # noqa: E402,F401  (before anything initialises CUDA: it may hide it)
from helpers import kernel_device  # noqa: E402  (before anything imports triton: it sets TRITON_INTERPRET)
import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        reason = "needs a CUDA device"
    elif kernel_device.interpreter_on():
        reason = "TRITON_INTERPRET=1: this session interprets the Triton kernels on CPU tensors"
    else:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not a keyword (a parameter id "gpu" is one)
            item.add_marker(skip)


def pytest_configure(config):
    if kernel_device.interpreter_on():  # numpy runs the kernels on NaN-poisoned buffers: expected
        config.addinivalue_line("filterwarnings", "ignore::RuntimeWarning:triton.runtime.interpreter")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    from helpers import launch  # before the test's fixtures: a module fixture may launch the ranks

    launch.TEST_MARKERS = frozenset(m.name for m in item.iter_markers())


def pytest_runtest_teardown(item):
    from helpers import launch

    launch.TEST_MARKERS = None


@pytest.fixture(autouse=True, scope="session")
def _outputs_are_poisoned():
    """Fail loudly if something imported areal_lce before the variable above was set."""
    from areal_lce.op.backends import base

    assert base.POISON == (os.environ[base.POISON_ENV] == "1"), \
        f"{base.POISON_ENV} was not set before areal_lce.op.backends was imported"
