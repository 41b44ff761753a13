"""Where the tests run the Triton kernels (helpers/kernel_device.py): one decision per process from the CUDA
device and TRITON_INTERPRET, and the `gpu` tests skipped under the interpreter (tests/conftest.py). This
machine takes one branch; the others run here with torch.cuda.is_available patched."""
import os
from types import SimpleNamespace

import pytest
import torch

import conftest
from helpers import kernel_device as K


@pytest.mark.parametrize("cuda, env, want_env, want_dev", [
    (True, None, None, "cuda"),  # a GPU machine: the compiled kernels, the variable left unset
    (False, None, "1", "cpu"),  # no CUDA: the interpreter on CPU tensors
    (True, "1", "1", "cpu"),  # the interpreter forced on a GPU machine
    (False, "0", "0", None),  # kernels turned off on a CPU machine: no kernel device
], ids=["gpu", "cpu", "forced-interpreter", "off"])
def test_one_decision_per_process(monkeypatch, cuda, env, want_env, want_dev):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    if env is None:
        monkeypatch.delenv(K.ENV, raising=False)
    else:
        monkeypatch.setenv(K.ENV, env)
    K.choose_interpreter()
    assert os.environ.get(K.ENV) == want_env
    dev = K.kernel_device()
    assert (dev.type if dev is not None else None) == want_dev
    if dev is None:
        with pytest.raises(pytest.skip.Exception, match="no device runs the Triton kernels"):
            K.on_kernel_device(torch.zeros(1))
    elif dev.type == "cpu":
        x, none = K.on_kernel_device(torch.zeros(1), None)
        assert x.device.type == "cpu" and none is None


def test_this_session_decided_before_triton(pytestconfig):
    """The session's own decision: the interpreter exactly where no CUDA device is (unless set by hand), and the
    kernels' launcher module read the same value when it was imported."""
    if os.environ.get(K.ENV) is None:
        assert torch.cuda.is_available()
    from areal_lce.op.backends.triton import launch

    assert launch.INTERPRET == K.interpreter_on()


@pytest.mark.parametrize("cuda, env, reason", [
    (False, "1", "needs a CUDA device"),
    (True, "1", "TRITON_INTERPRET=1"),
    (True, "0", None),
])
def test_gpu_tests_skip_without_cuda_and_under_the_interpreter(monkeypatch, cuda, env, reason):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setenv(K.ENV, env)
    added = []
    items = [SimpleNamespace(get_closest_marker={"gpu": pytest.mark.gpu}.get, add_marker=added.append),
             SimpleNamespace(get_closest_marker={}.get, add_marker=added.append)]
    conftest.pytest_collection_modifyitems(None, items)
    if reason is None:
        assert added == []
    else:
        assert len(added) == 1 and reason in added[0].kwargs["reason"]
