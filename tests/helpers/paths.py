"""Where things are, for every test, worker and helper (one definition instead of one per file).

    REPO   the checkout (configs/, benchmark/, docs/, torchrun/ and the areal_lce package)
    TESTS  tests/ (on sys.path under pytest through tests/conftest.py, and on the PYTHONPATH of every
           launch through helpers.launch.torchrun, so `import helpers.<module>` works in both)
"""
from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
