"""The lanes (tests/lanes.py) on suites of their own, under the project's pytest.ini: every test lands in exactly one,
and a test with none or two stops the run, naming it."""

from __future__ import annotations

import pytest

from conftest import ROOT
from lanes import LANES

CONFTEST = "from lanes import pytest_collection_modifyitems  # noqa: F401\n"


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    """An empty suite with the project's pytest.ini (its lane markers, --strict-markers) and the lanes' hook."""
    pytester.makefile(".ini", pytest=(ROOT / "pytest.ini").read_text().replace("testpaths = tests\n", ""))
    pytester.makeconftest(CONFTEST)
    return pytester


def selected(suite: pytest.Pytester, lane: str) -> list[str]:
    result = suite.runpytest("--collect-only", "-q", "-m", lane)
    assert result.ret == 0, result.outlines + result.errlines
    return sorted(line for line in result.outlines if "::" in line)


def test_the_lanes_are_registered_in_pytest_ini() -> None:
    ini = (ROOT / "pytest.ini").read_text()
    assert "--strict-markers" in ini
    for lane in LANES:
        assert f"\n    {lane}: " in ini, lane


def test_tests_outside_integration_are_unit_and_integration_modules_name_their_lane(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_plain="def test_a(): pass\n")
    suite.mkdir("integration")
    (suite.path / "integration" / "test_cluster.py").write_text(
        "import pytest\npytestmark = pytest.mark.rehearsal\ndef test_b(): pass\n")
    (suite.path / "integration" / "test_controller.py").write_text(
        "import pytest\npytestmark = pytest.mark.slurm\ndef test_c(): pass\n")
    assert selected(suite, "unit") == ["test_plain.py::test_a"]
    assert selected(suite, "rehearsal") == ["integration/test_cluster.py::test_b"]
    assert selected(suite, "slurm") == ["integration/test_controller.py::test_c"]


def test_an_integration_test_without_a_lane_stops_the_run(suite: pytest.Pytester) -> None:
    suite.mkdir("integration")
    (suite.path / "integration" / "test_cluster.py").write_text("def test_b(): pass\n")
    result = suite.runpytest("-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*exactly one lane*", "*integration/test_cluster.py::test_b: no lane"])


def test_a_test_in_two_lanes_stops_the_run(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_plain="import pytest\n@pytest.mark.rehearsal\ndef test_a(): pass\n")
    result = suite.runpytest("-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_plain.py::test_a: unit, rehearsal"])


def test_a_misspelt_lane_is_an_error(suite: pytest.Pytester) -> None:
    suite.mkdir("integration")
    (suite.path / "integration" / "test_cluster.py").write_text(
        "import pytest\npytestmark = pytest.mark.reharsal\ndef test_b(): pass\n")
    result = suite.runpytest("-q")
    assert result.ret != pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*'reharsal' not found in `markers` configuration option*"])
