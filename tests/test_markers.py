"""The test markers: registered (--strict-markers), and a multi-rank launch needs `distributed`."""
import pytest

from helpers import launch


def test_launching_ranks_without_the_distributed_marker_is_refused(tmp_path):
    assert launch.TEST_MARKERS is not None and "distributed" not in launch.TEST_MARKERS
    with pytest.raises(AssertionError, match="without @pytest.mark.distributed"):
        launch.torchrun(tmp_path / "never_started.py", nproc=2, timeout=1)


def test_markers_are_registered(pytestconfig):
    registered = {line.split(":")[0] for line in pytestconfig.getini("markers")}
    assert {"gpu", "distributed", "slow"} <= registered
    assert "--strict-markers" in pytestconfig.getini("addopts")
