"""The backend contract as code (areal_lce/op/backends/base.py): every backend subclasses `Backend`, the call
runs on the one instance api.py resolves (its methods, its defaults where it has none), and the core
neither looks a backend up by name nor probes it with getattr / hasattr."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import areal_lce
from areal_lce.op import backends, library
from areal_lce.op.backends.base import Backend
from areal_lce.op.backends.torch_chunked import TorchChunkedBackend
from helpers.inputs import available_backends

# the op's core: what runs between api.py's resolution and the backend
CORE = ("function.py", "exact.py", "select.py", "select_grad.py", "library.py")


@pytest.mark.parametrize("name", available_backends())
def test_every_backend_subclasses_the_contract(name):
    be = backends.get_backend(name)
    assert isinstance(be, Backend) and be.name == name
    assert backends.get_backend(name) is be  # one instance per backend


def test_capabilities_are_declared_with_their_defaults():
    """A backend with its three abstract methods alone gets every default (the torch steps of the core)."""
    assert (Backend.skips_ignored_rows, Backend.supports_softcap, Backend.takes_sparse, Backend.extracts_selected,
            Backend.ranks_topk, Backend.fused_rows, Backend.record_labels) == (False, True, False, False, False,
                                                                                False, None)
    with pytest.raises(TypeError, match="abstract"):
        Backend()


def _probes(path):
    """(line, what) of every getattr / hasattr on a name mentioning 'backend', and every get_backend call."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        if node.func.id in ("getattr", "hasattr") and "backend" in ast.unparse(node.args[0]) \
                or node.func.id in ("backend_of", "fused_step", "backend_fn"):
            found.append((node.lineno, ast.unparse(node)))
        elif node.func.id == "get_backend" and path.name != "library.py":  # library.decode: the op boundary
            found.append((node.lineno, ast.unparse(node)))
    return found


@pytest.mark.parametrize("module", CORE)
def test_the_core_neither_probes_nor_looks_up_a_backend(module):
    assert _probes(Path(areal_lce.op.__file__).parent / module) == []


class _Counting(TorchChunkedBackend):
    """The torch backend, counting the calls of the defaults the core reaches through the instance."""

    def __init__(self):
        self.calls = {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def fold_segments(self, *args):
        self._count("fold_segments")
        return super().fold_segments(*args)

    def finish_folded(self, *args):
        self._count("finish_folded")
        return super().finish_folded(*args)

    def gather_logits(self, *args):
        self._count("gather_logits")
        return super().gather_logits(*args)

    def segment_logits(self, *args):
        self._count("segment_logits")
        return super().segment_logits(*args)


def _call(**kw):
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(9, 16, generator=g, requires_grad=True), torch.randn(300, 16, generator=g)
    y = torch.randint(0, 300, (9,), generator=g)
    sel = torch.randint(0, 300, (9, 3), generator=g)
    out = areal_lce.linear_logprobs_entropy(h, w, y, backend="torch", invariant=True, selected_ids=sel, top_k=2,
                                            softcap=5.0, **kw)
    (out.logprobs.sum() + out.selected_logprobs.sum()).backward()
    return [t.detach() for t in out if t is not None] + [h.grad]


def test_the_call_runs_on_the_resolved_instance(monkeypatch):
    """Swapping the instance behind the name changes what every step of the call runs on (forward merge,
    selected gather, top-k recompute, the softcap slope in the backward), with the same bits."""
    want = _call()
    counting = _Counting()
    library.decode.cache_clear()  # its LCEParams hold the instance of their options string
    monkeypatch.setitem(backends._LOADED, "torch", counting)
    try:
        got = _call()
    finally:
        library.decode.cache_clear()
    assert counting.calls == {"fold_segments": 1, "finish_folded": 1, "gather_logits": 2, "segment_logits": 1}
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == len(want)
