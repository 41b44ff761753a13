"""areal_lce.patching, the one reversible patch helper, and the patches built on it: each can be undone
with the original object back (identity), including the two that used to be permanent (the device grad
norm, the fused RoPE slots) and the CPU shims' class attribute. One process, no model: fast."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from areal_lce import patching
from areal_lce.patching import Patch, PatchError


def _module(name="patch_target", **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def test_apply_restore_gives_the_original_object_back_once():
    mod = _module(f=len)
    handle = patching.apply(Patch(mod, "f", abs))
    assert mod.f is abs and patching.is_patched(mod, "f") and patching.original(mod, "f") is len
    assert patching.restore(handle) and mod.f is len and not patching.is_patched(mod, "f")
    assert not patching.restore(handle) and mod.f is len  # idempotent


def test_a_missing_attribute_is_refused_and_nothing_is_set():
    mod = _module(f=len)
    with pytest.raises(PatchError, match=r"patch_target\.g does not exist"):
        patching.apply(Patch(mod, "f", abs), Patch(mod, "g", abs))
    assert mod.f is len and not patching.is_patched(mod, "f") and not hasattr(mod, "g")


def test_a_failure_part_way_rolls_back_the_patches_already_set():
    class Guarded:
        f = staticmethod(len)

        def __setattr__(self, name, value):
            if value is max:
                raise RuntimeError("read-only here")
            object.__setattr__(self, name, value)

    mod, guarded = _module(f=len), Guarded()
    guarded.g = min
    with pytest.raises(RuntimeError, match="read-only"):
        patching.apply(Patch(mod, "f", abs), Patch(guarded, "g", max))
    assert mod.f is len and guarded.g is min
    assert not patching.is_patched(mod, "f") and not patching.is_patched(guarded, "g")


def test_nested_patches_stack_and_restore_in_any_order():
    mod = _module(f=len)
    outer = patching.apply(Patch(mod, "f", abs))
    inner = patching.apply(Patch(mod, "f", min))
    assert mod.f is min and patching.original(mod, "f") is len
    outer.restore()  # not on top: the newest layer stays in place
    assert mod.f is min
    inner.restore()
    assert mod.f is len
    with patching.patched(Patch(mod, "f", abs)):
        with patching.patched(Patch(mod, "f", min)):
            assert mod.f is min
        assert mod.f is abs
    assert mod.f is len


def test_an_inherited_attribute_is_deleted_again_not_copied_onto_the_owner():
    class Base:
        def forward(self):
            return "class"

    obj = Base()
    with patching.patched(Patch(obj, "forward", lambda: "instance")):
        assert obj.forward() == "instance"
    assert "forward" not in vars(obj) and obj.forward() == "class"
    with pytest.raises(ValueError):
        with patching.patched(Patch(Base, "__repr__", lambda self: "x")):
            raise ValueError("restored on error too")
    assert "__repr__" not in vars(Base)


def test_a_class_attribute_is_restored_as_stored():
    class Owner:
        @staticmethod
        def make():
            return "static"

    stored = vars(Owner)["make"]
    with patching.patched(Patch(Owner, "make", staticmethod(lambda: "patched"))):
        assert Owner().make() == "patched"
    assert vars(Owner)["make"] is stored and Owner().make() == "static"  # still a staticmethod


def test_restoring_over_a_later_replacement_warns():
    mod = _module(f=len)
    handle = patching.apply(Patch(mod, "f", abs))
    mod.f = max  # someone else replaced the patch
    with pytest.warns(RuntimeWarning, match="replaced by something else"):
        handle.restore()
    assert mod.f is len


def test_adapter_patches_keep_the_framework_original_and_roll_back_only_their_own_call(monkeypatch):
    from areal_lce.integrations import _common

    a, b = _module("fw_a", fn=len), _module("fw_b")  # fw_b: a version without the function
    monkeypatch.setitem(sys.modules, "fw_a", a)
    monkeypatch.setitem(sys.modules, "fw_b", b)
    assert _common.patch_all(["fw_a"], "fn", abs) == ["fw_a.fn"]
    with pytest.raises(RuntimeError, match="has no attribute 'fn'"):
        _common.patch_all(["fw_a", "fw_b"], "fn", min)
    assert a.fn is abs  # the failed call undid nothing but its own patches
    _common.patch("fw_a", "fn", min)  # patching again replaces the replacement
    assert a.fn is min
    assert _common.restore_all(["fw_a", "fw_b"], "fn") == ["fw_a.fn"] and a.fn is len
    assert not _common.restore("fw_a", "fn")


def test_cpu_shims_leave_every_owner_as_it_was():
    from areal_lce.megatron import compat

    if torch.cuda.is_available():
        pytest.skip("cpu_shims is a no-op with CUDA")
    before = {name: vars(torch.Tensor).get(name) for name in ("cuda",)}
    current_device = torch.cuda.current_device
    with compat.cpu_shims():
        with compat.cpu_shims():  # re-entrant
            assert torch.cuda.current_device() == torch.device("cpu") and torch.ones(1).cuda().device.type == "cpu"
        assert compat.shims_active()
    assert not compat.shims_active() and torch.cuda.current_device is current_device
    # Tensor.cuda lives on torch's C base class: restoring must not leave a copy on torch.Tensor itself
    assert {name: vars(torch.Tensor).get(name) for name in ("cuda",)} == before


def test_the_device_grad_norm_can_be_undone():
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    from areal_lce.megatron import compat

    local = getattr(utils, "local_multi_tensor_l2_norm", None)
    if clip_grads.l2_norm_impl is not local:
        pytest.skip("Apex / Transformer Engine provide the norm: nothing is replaced")
    original = clip_grads.l2_norm_impl
    assert compat.use_device_grad_norm() and compat.use_device_grad_norm()  # idempotent
    assert clip_grads.l2_norm_impl is compat._l2_norm_on_device
    assert compat.restore_device_grad_norm() and clip_grads.l2_norm_impl is original
    assert not compat.restore_device_grad_norm()


def test_the_fused_rope_slots_can_be_emptied_again(monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    from areal_lce.engine.model import rope

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", None)
    assert rope.install_rope_fusion() and rope.install_rope_fusion()
    assert rope_utils.fused_apply_rotary_pos_emb is rope.fused_rope_sbhd
    assert rope.remove_rope_fusion() and not rope.remove_rope_fusion()
    assert rope_utils.fused_apply_rotary_pos_emb is None and rope_utils.fused_apply_rotary_pos_emb_thd is None
