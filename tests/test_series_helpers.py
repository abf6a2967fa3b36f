"""The window helpers' one-value fast paths (the live case) agree with their many-value path."""

from __future__ import annotations

import numpy as np
import pytest

from trainguard.detectors.series import (
    ema,
    quadratic_residuals,
    rolling_median,
    spread_sigmas,
    trailing_means,
    warm_ema,
)


@pytest.fixture
def values() -> np.ndarray:
    rng = np.random.default_rng(3)
    return 2.0 + np.cumsum(rng.standard_normal(400)) * 0.01 + rng.standard_t(4, 400) * 0.05


@pytest.mark.parametrize("width", [5, 6, 20, 100])
def test_rolling_median_one_window_matches_many(values: np.ndarray, width: int) -> None:
    many = rolling_median(values, width)
    for end in (width, 57 + width, len(values)):
        one = rolling_median(values[end - width : end], width)
        assert one.shape == (1,)
        assert one[0] == many[end - width]
    assert np.isnan(rolling_median(np.array([1.0, np.nan, 3.0, 4.0, 5.0]), 5)[0])


@pytest.mark.parametrize(("held", "window"), [(0, 10), (7, 10), (100, 100), (150, 100)])
def test_trailing_means_one_value_matches_many(values: np.ndarray, held: int, window: int) -> None:
    many = trailing_means(values, held, window)
    for k in (0, 9, 200):
        one = trailing_means(values[: held + k + 1], held + k, window)
        assert one.shape == (1,)
        np.testing.assert_allclose(one[0], many[k], rtol=1e-12, equal_nan=True)


def test_ema_one_value_matches_many(values: np.ndarray) -> None:
    many = ema(values, 1.5, 0.02)
    y = 1.5
    for k, x in enumerate(values[:50]):
        step = ema(np.array([x]), y, 0.02)
        assert step[0] == y
        np.testing.assert_allclose(step[1], many[k + 1], rtol=1e-12)
        y = float(step[1])


@pytest.mark.parametrize("count", [0, 30, 99, 100, 500])
def test_warm_ema_one_value_matches_many(values: np.ndarray, count: int) -> None:
    many = warm_ema(values[:150], 0.7, count, 100)
    y = 0.7
    for k, x in enumerate(values[:150]):
        step = warm_ema(np.array([x]), y, count + k, 100)
        np.testing.assert_allclose(step[1], many[k + 1], rtol=1e-10)
        y = float(step[1])


def test_quadratic_residuals_and_spread_match_a_fresh_fit(values: np.ndarray) -> None:
    rows = np.lib.stride_tricks.sliding_window_view(values, 64)[::37]
    t = np.linspace(-1.0, 1.0, 64)
    basis = np.vstack((np.ones(64), t, t * t)).T
    fresh = rows - (rows @ np.linalg.pinv(basis).T) @ basis.T
    np.testing.assert_array_equal(quadratic_residuals(rows), fresh)
    centre = np.median(fresh, axis=1, keepdims=True)
    mad = np.median(np.abs(fresh - centre), axis=1)
    np.testing.assert_array_equal(spread_sigmas(rows), 1.4826 * mad * np.sqrt(64 / 61))
    for r in range(len(rows)):  # one row against many: the matrix product rounds apart only
        np.testing.assert_allclose(spread_sigmas(rows[r : r + 1])[0], spread_sigmas(rows)[r])
