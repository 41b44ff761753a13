"""What a run prints: megatron-core's notices that ask nothing of the user are hidden where areal_lce
triggers them (model build; the CUDA-only advice on a CPU run), the rest still reaches the user."""
import warnings

import pytest
import torch

from areal_lce.device import cuda_advice_hidden_on_cpu

ADVICE = ("When using async grad allreduce it is recommended to set the environment variable "
          "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup")  # megatron-core's tensor_parallel/layers.py


def _shown(fn):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in seen]


@pytest.mark.parametrize("device, hidden", [("cpu", True), ("cuda", False)])
def test_cuda_advice_is_hidden_on_cpu_only(device, hidden):
    def run():
        with cuda_advice_hidden_on_cpu(torch.device(device)):
            warnings.warn(ADVICE, UserWarning)
            warnings.warn("something else", UserWarning)  # every other warning passes
    shown = _shown(run)
    assert (ADVICE in shown) is not hidden and "something else" in shown
    assert not any(ADVICE in m for m in _shown(lambda: None))  # the filter ends with the block
    assert ADVICE in _shown(lambda: warnings.warn(ADVICE, UserWarning))


def test_building_the_engine_model_shows_no_megatron_construction_notices():
    from areal_lce.engine.config import LCEConfig
    from helpers.engines import tiny_engine

    shown = _shown(lambda: tiny_engine(300, model=dict(max_seq_len=32), lce=LCEConfig()))
    noise = [m for m in shown if "full scope is deprecated" in m or "MLP requires ffn_hidden_size" in m]
    assert not noise, noise
