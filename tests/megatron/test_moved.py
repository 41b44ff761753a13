"""The engine moved from areal_lce.megatron to areal_lce.engine: the old names and module paths keep working
for one release, each with a DeprecationWarning naming the new place; the seam itself does not warn."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import areal_lce.engine as engine_pkg
from areal_lce.megatron import _moved


@pytest.mark.parametrize("name", sorted(_moved.NAMES))
def test_old_package_names_warn_and_give_the_new_objects(name):
    import areal_lce.megatron as m
    with pytest.warns(DeprecationWarning, match=f"areal_lce.megatron.{name} moved to areal_lce.engine.{name}"):
        obj = getattr(m, name)
    assert obj is getattr(engine_pkg, name)


@pytest.mark.slow
def test_old_module_paths_forward_to_the_new_modules():
    # a fresh interpreter: the import system caches modules
    code = ("import warnings, importlib\n"
            "warnings.simplefilter('error', DeprecationWarning)\n"
            "import areal_lce.megatron\n"  # the seam alone: no warning
            "warnings.simplefilter('always')\n"
            f"pairs = {sorted(_moved.MODULES.items())!r}\n"
            "for old, new in pairs:\n"
            "    with warnings.catch_warnings(record=True) as w:\n"
            "        warnings.simplefilter('always')\n"
            "        mod = importlib.import_module('areal_lce.megatron.' + old)\n"
            "    assert any(new in str(x.message) for x in w), (old, [str(x.message) for x in w])\n"
            "    real = importlib.import_module(new)\n"
            "    public = [n for n in vars(real) if not n.startswith('_')][:5]\n"
            "    assert all(getattr(mod, n) is getattr(real, n) for n in public), old\n"
            "from areal_lce.megatron.engine import MegatronEngine\n"
            "from areal_lce.engine import MegatronEngine as M2\n"
            "assert MegatronEngine is M2\n"
            "print('ok', len(pairs))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-3000:]


def test_unknown_names_still_fail():
    import areal_lce.megatron as m
    with pytest.raises(AttributeError):
        m.NoSuchThing  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("areal_lce.megatron.no_such_module")
