"""The suite's guard against creep (tests/conftest.py): a test over the limit without a
`slow(reason)` marker is listed after the run; a marker without a reason is a usage error."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

# the hooks as they are, without the torch settings (no torch import in the inner runs)
CONFTEST = (
    Path(__file__)
    .with_name("conftest.py")
    .read_text()
    .replace("import torch\n", "")
    .replace("torch.set_num_threads(1)\n", "")
)


def test_a_test_over_the_limit_is_listed_unless_it_says_why(pytester: pytest.Pytester) -> None:
    assert "SLOW_TEST_S = 20.0" in CONFTEST
    pytester.makeconftest(CONFTEST.replace("SLOW_TEST_S = 20.0", "SLOW_TEST_S = 0.2"))
    pytester.makepyfile(
        test_some="""
        import time
        import pytest

        def test_quick():
            pass

        def test_sleepy():
            time.sleep(0.5)

        @pytest.mark.slow("it waits on purpose")
        def test_explained():
            time.sleep(0.5)
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
    listed = result.stdout.str().split("without a slow(reason) marker", 1)[1]
    assert "test_some.py::test_sleepy" in listed
    assert "test_explained" not in listed and "test_quick" not in listed


def test_a_slow_marker_without_a_reason_stops_the_run(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_some="""
        import pytest

        @pytest.mark.slow
        def test_unexplained():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "give @pytest.mark.slow a reason string" in result.stderr.str()
