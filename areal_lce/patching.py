"""Reversible attribute patches: the one mechanism behind every monkeypatch areal_lce makes.

    from areal_lce.patching import Patch, apply, patched, restore

    handle = apply(Patch(module, "fn", replacement), Patch(other, "fn", replacement))
    ...
    restore(handle)                      # both back, in reverse order; a second restore does nothing
    with patched(Patch(torch.cuda, "synchronize", lambda: None)):
        ...                              # restored on exit, also on error

The contract:
  * all or none: `apply` refuses an attribute the owner does not have (the code it targets moved, so
    the patch would silently do nothing), raising `PatchError` (an AttributeError) that names
    owner.attribute; on any failure the patches already set by that call are undone before it raises.
  * the original is remembered once per (owner, attribute), however many handles patch it: it is the
    value put back when the last of them is restored, and `original()` returns it meanwhile. An
    attribute the owner only inherited (a class method seen through an instance, a base-class method
    seen through a subclass) is deleted again rather than set, so the owner's `vars()` are as before.
  * nested patches of one attribute stack: restoring a handle drops its layer; the attribute then holds
    the newest layer still applied, or the original. Handles may be restored in any order.
  * `restore` is idempotent (False when the handle was already restored), and so is `patched`'s exit.
    It warns (RuntimeWarning) when something else replaced the attribute after the patch: restoring
    drops that replacement.

Not thread-safe: patches are set up where the program starts a component (an adapter's `apply`, an
engine's construction) or around one call, not concurrently.
"""
from __future__ import annotations

import contextlib
import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

_MISSING = object()


class PatchError(AttributeError):
    """An attribute to patch does not exist on its owner."""


@dataclass(frozen=True)
class Patch:
    """owner.name = new while applied (owner: a module, class or instance)."""

    owner: Any
    name: str
    new: Any

    def where(self) -> str:
        owner = self.owner
        label = getattr(owner, "__name__", None) or f"<{type(owner).__name__} object>"
        return f"{label}.{self.name}"


class _Slot:
    """One patched attribute: its original (remembered once) and the values of the handles on it."""

    def __init__(self, owner, name: str):
        self.owner, self.name = owner, name
        try:
            self.own = name in vars(owner)
            # the owner's own entry as stored (a staticmethod stays one), else what it inherits
            self.original = vars(owner)[name] if self.own else getattr(owner, name)
        except TypeError:  # no __dict__ (slots): the attribute is its own
            self.own, self.original = True, getattr(owner, name)
        self.layers: List[Tuple[int, Any]] = []  # (handle id, value), oldest first

    def show(self) -> None:
        """Set the owner's attribute to the newest layer's value, or put the original back."""
        if self.layers:
            setattr(self.owner, self.name, self.layers[-1][1])
        elif self.own:
            setattr(self.owner, self.name, self.original)
        else:
            delattr(self.owner, self.name)


_SLOTS: Dict[Tuple[int, str], _Slot] = {}  # (id(owner), name) -> slot; the slot holds the owner alive


class Handle:
    """What `apply` returns: the patches it set, restored (in reverse order) by `restore(handle)` or
    `handle.restore()`. Usable as a context manager."""

    def __init__(self, patches: Tuple[Patch, ...]):
        self.patches = patches
        self.applied = False

    def restore(self) -> bool:
        return restore(self)

    def __enter__(self) -> "Handle":
        return self

    def __exit__(self, *exc) -> None:
        restore(self)

    def __repr__(self) -> str:
        state = "applied" if self.applied else "restored"
        return f"Handle({', '.join(p.where() for p in self.patches)}; {state})"


def _drop(handle: Handle, patch: Patch) -> None:
    key = (id(patch.owner), patch.name)
    slot = _SLOTS.get(key)
    if slot is None:
        return
    on_top = bool(slot.layers) and slot.layers[-1][0] == id(handle)
    for i in range(len(slot.layers) - 1, -1, -1):
        if slot.layers[i][0] == id(handle):
            del slot.layers[i]
            break
    if not slot.layers:
        del _SLOTS[key]
    if on_top:
        slot.show()


def _check_unchanged(handle: Handle, patch: Patch) -> None:
    """Warn when something else replaced a patched attribute since: restoring drops that replacement."""
    slot = _SLOTS.get((id(patch.owner), patch.name))
    if slot is None or not slot.layers or slot.layers[-1][0] != id(handle):
        return
    if inspect.getattr_static(patch.owner, patch.name, _MISSING) is not slot.layers[-1][1]:
        warnings.warn(f"areal_lce.patching: {patch.where()} was replaced by something else after it was patched; "
                      "restoring the patch drops that replacement", RuntimeWarning, stacklevel=4)


def apply(*patches: Patch) -> Handle:
    """Set every patch, all or none (module docstring); returns the handle that restores them."""
    for p in patches:
        if not isinstance(p, Patch):
            raise TypeError(f"areal_lce.patching.apply takes Patch(owner, name, new) values, got {type(p).__name__}")
    handle = Handle(tuple(patches))
    done: List[Patch] = []
    try:
        for p in patches:
            key = (id(p.owner), p.name)
            slot = _SLOTS.get(key)
            if slot is None:
                if getattr(p.owner, p.name, _MISSING) is _MISSING:
                    raise PatchError(f"{p.where()} does not exist, so patching it would change nothing: the "
                                     "code it targets has moved or is another version")
                slot = _Slot(p.owner, p.name)
                _SLOTS[key] = slot
            slot.layers.append((id(handle), p.new))
            done.append(p)  # before setattr: a failed set is rolled back too
            setattr(p.owner, p.name, p.new)
    except BaseException:
        for p in reversed(done):
            _drop(handle, p)
        raise
    handle.applied = True
    return handle


def restore(handle: Handle) -> bool:
    """Undo `handle`'s patches in reverse order; False when it was already restored."""
    if not handle.applied:
        return False
    handle.applied = False
    for p in reversed(handle.patches):
        _check_unchanged(handle, p)
        _drop(handle, p)
    return True


@contextlib.contextmanager
def patched(*patches: Patch):
    """`apply(*patches)` for the block; restored on exit, also on error. Yields the handle."""
    handle = apply(*patches)
    try:
        yield handle
    finally:
        restore(handle)


def original(owner, name: str):
    """What owner.name was before the patches now applied to it (its current value when none is)."""
    slot = _SLOTS.get((id(owner), name))
    return getattr(owner, name) if slot is None else slot.original


def is_patched(owner, name: str) -> bool:
    """True while some handle's patch of owner.name is applied."""
    return (id(owner), name) in _SLOTS
