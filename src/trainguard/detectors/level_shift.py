"""Level shifts: the loss steps up to a new level and stays there (a resume that came back
worse, a data-loader bug, a run that blew up and froze), judged over a whole logged run and
sized by how far it moved (in the loss's units and in its noise) and how long it stayed."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from trainguard.detectors.base import fmt
from trainguard.detectors.series import rolling_median
from trainguard.detectors.stats import MAD_TO_SIGMA, WARM_RESTART
from trainguard.events import Event, Severity

LEVEL_Z = 8.0  # the new level clears the old by this many noise SDs of a window's median
RESTART_Z = 5.0  # ... at a restart the log shows (the steps went back, or a gap): a known cause
MIN_REL_SHIFT = 0.05  # and by this share of the old level
MULTIPLIED = 2.0  # a new level this many times the old one is critical at any length
MULTIPLIED_Z = 3.0  # ... where it clears this many noise SDs (the windows of a short log are few)
HOLD_PARTS = 3  # each third of the window after the step has its median over the step's midpoint
MIN_POINTS, MAX_POINTS = 3, 64  # the windows before and after a step, in (reduced) points
WINDOW_SHARE = 10  # ... a tenth of the log's points, within those bounds
MOST_POINTS = 4096  # a longer log is judged on the medians of blocks of its points
FROZEN_POINTS = 3  # equal losses in a row after a step: the loss froze (a dead run)
REFINE_POINTS = 8  # the onset is placed where the mean of this many points after it most
# exceeds the mean of as many before (in reduced points)
SPREAD_POINTS = 6  # points before a step from which their spread about a line is read too
GAP_SPACINGS = 5.0  # a step gap this many median spacings wide is a restart


@dataclass
class _Shift:
    onset: int  # index of the first point at the new level
    before: float
    after: float
    noise: float  # of one point
    z: float  # of the step against the noise of a window's median


def level_shifts(
    steps: np.ndarray,
    loss: np.ndarray,
    lr: np.ndarray | None = None,
    restarts: np.ndarray | None = None,
) -> list[Event]:
    """The persistent steps up of the loss in a logged run, one `level_shift` event each at the
    step where the new level begins: the median of the points after it over the median of the
    points before by `LEVEL_Z` noise SDs of such a median (`RESTART_Z` at a restart in
    `restarts`) and by `MIN_REL_SHIFT` of the level, each third of the points after it with its
    median over the midpoint; the windows span a tenth of the log (3 to 64 points). A step
    within a window of an LR jump (a warm restart) is passed over. Critical where the level
    multiplied by `MULTIPLIED` or the loss froze after it, else a warning. A restart that
    resumes lower or level raises nothing."""
    ok = np.isfinite(loss)
    idx = np.flatnonzero(ok)
    v = np.asarray(loss[ok], dtype=np.float64)
    if len(v) < 2 * MIN_POINTS:
        return []
    block = max(1, math.ceil(len(v) / MOST_POINTS))
    m = len(v) // block
    u = np.median(v[: m * block].reshape(m, block), axis=1) if block > 1 else v
    w = min(max(m // WINDOW_SHARE, MIN_POINTS), MAX_POINTS)
    if m < 2 * w:
        return []
    restart_points = _restart_points(steps[idx], restarts)
    jumped = _lr_jumps(lr, idx, block, m)
    shifts = _find(u, w, restart_points // block, jumped)
    events = []
    for s in shifts:
        first = _first_point(v, s, block, w)
        # a restart the log shows within half a window of the step is where it began
        near = restart_points[np.abs(restart_points - first) <= (w // 2 + 1) * block]
        at_restart = bool(len(near))
        if at_restart:  # the step is the restart's: the new level begins there
            first = int(near[np.argmin(np.abs(near - first))])
        events.append(_event(steps, v, u, block, idx, first, s, w * block, at_restart))
    return events


def restarts_of(abandoned: np.ndarray | None) -> np.ndarray:
    """The steps where a log restarted (a resume, a rollback's replay) from the steps of the
    rows a later row of the same step replaced, in file order (`LogData.abandoned`): the first
    step of each run of them (a run ends where the steps go back or skip more than twice their
    usual spacing)."""
    if abandoned is None or not len(abandoned):
        return np.empty(0, dtype=np.int64)
    gaps = np.diff(abandoned)
    spacing = float(np.median(gaps[gaps > 0])) if (gaps > 0).any() else 1.0
    starts = np.concatenate(([True], (gaps <= 0) | (gaps > 2 * spacing)))
    out: np.ndarray = abandoned[starts]
    return out


def _restart_points(steps: np.ndarray, restarts: np.ndarray | None) -> np.ndarray:
    """The points (indices into the finite losses) where the log shows a restart: the first
    point at or after each step of `restarts`, and the first point after a gap of
    `GAP_SPACINGS` median spacings."""
    found: list[int] = []
    if len(steps) > 2:
        gaps = np.diff(steps)
        spacing = float(np.median(gaps))
        found += (np.flatnonzero(gaps > GAP_SPACINGS * max(spacing, 1.0)) + 1).tolist()
    if restarts is not None and len(restarts):
        found += np.searchsorted(steps, restarts).tolist()
    return np.unique(np.asarray(found, dtype=np.int64))


def _lr_jumps(lr: np.ndarray | None, idx: np.ndarray, block: int, m: int) -> np.ndarray:
    """Per (reduced) point: whether the LR jumped by `WARM_RESTART` from one logged value to the
    next there (a warm restart lifts the loss by design)."""
    out = np.zeros(m, dtype=bool)
    if lr is None:
        return out
    rates = lr[idx]
    known = np.flatnonzero(np.isfinite(rates))
    if len(known) < 2:
        return out
    r = rates[known]
    up = known[1:][r[1:] > WARM_RESTART * r[:-1]]
    out[np.minimum(up // block, m - 1)] = True
    return out


def _find(u: np.ndarray, w: int, restart_points: np.ndarray, jumped: np.ndarray) -> list[_Shift]:
    """The level shifts of the (reduced) series `u` with windows of `w` points: candidates
    where the cheap tests pass, then each cluster's largest step judged against the noise."""
    m = len(u)
    medians = rolling_median(u, w)  # of the w points from each point on
    before, after = medians[: m - 2 * w + 1], medians[w:]  # ending at i - 1, starting at i
    onsets = np.arange(w, m - w + 1)
    with np.errstate(invalid="ignore"):
        rel = (after - before) / np.abs(before)
        candidate = (rel >= MIN_REL_SHIFT) & (np.abs(before) > 0)
    restart = np.zeros(m + 1, dtype=bool)
    restart[np.clip(restart_points, 0, m)] = True
    jumps_before = np.concatenate(([0], np.cumsum(jumped)))  # LR jumps before each point
    shifts: list[_Shift] = []
    free_from = 0  # a later step must have its whole window before it past the last one
    hits = np.flatnonzero(candidate)
    k = 0
    while k < len(hits):
        run_end = k
        while run_end + 1 < len(hits) and hits[run_end + 1] == hits[run_end] + 1:
            run_end += 1
        cluster = hits[k : run_end + 1]
        k = run_end + 1
        cluster = cluster[onsets[cluster] >= free_from]
        if not len(cluster):
            continue
        # a restart inside the cluster is where its step is judged first (a known cause)
        tried = [int(c) for c in cluster if restart[onsets[c]]]
        # then the largest steps first: a median moves before the step does, where the window
        # after it holds half the new level, and such an onset does not hold
        by_size = cluster[np.argsort(before[cluster] - after[cluster], kind="stable")]
        tried += [int(c) for c in by_size[: 2 * w + 2]]
        for c in tried:
            i = int(onsets[c])
            if jumps_before[min(i + w, m)] > jumps_before[max(i - w, 0)]:
                continue  # the LR jumped within a window of the step: a warm restart's lift
            shift = _judged(u, i, w, float(before[c]), float(after[c]), bool(restart[i]))
            if shift is not None:
                shifts.append(shift)
                free_from = i + w
                break
    return shifts


def _judged(
    u: np.ndarray, i: int, w: int, level: float, new: float, at_restart: bool
) -> _Shift | None:
    """The step up at point `i` if it holds (each of `HOLD_PARTS` parts of the window after it
    with its median over the midpoint) and clears the noise of a window's median; else None."""
    mid = 0.5 * (level + new)
    if any(float(np.median(part)) <= mid for part in np.array_split(u[i : i + w], HOLD_PARTS)):
        return None  # it did not hold through the window: a spike that decays, not a level
    history = u[max(i - 4 * w, 0) : i]
    noise = _noise(history)
    # two medians of w points differ by chance with this SD (a median's SE is sqrt(pi/2) a mean's)
    unit = noise * math.sqrt(math.pi / 2) * math.sqrt(2.0 / w)
    z = (new - level) / unit if unit > 0 else math.inf
    multiplied = new >= MULTIPLIED * level > 0
    needed = MULTIPLIED_Z if multiplied else RESTART_Z if at_restart else LEVEL_Z
    if z < needed:
        return None
    return _Shift(i, level, new, noise, z)


def _noise(values: np.ndarray) -> float:
    """The noise of one point, as a standard deviation: the larger of the estimate from the
    first differences less their median (robust to the loss's fall and to a few outliers) and
    the spread about a fitted line (which noise that carries over from point to point, as a
    data order's does, keeps and the differences lose)."""
    if len(values) < 3:
        return 0.0
    diffs = np.diff(values)
    centre = float(np.median(diffs))
    from_diffs = MAD_TO_SIGMA * float(np.median(np.abs(diffs - centre))) / math.sqrt(2.0)
    n = len(values)
    if n < SPREAD_POINTS:
        return from_diffs
    t = np.arange(n, dtype=np.float64)
    slope, intercept = np.polyfit(t, values, 1)
    residuals = values - (slope * t + intercept)
    spread = MAD_TO_SIGMA * float(np.median(np.abs(residuals - np.median(residuals))))
    return max(from_diffs, spread * math.sqrt(n / (n - 2)))


def _first_point(v: np.ndarray, s: _Shift, block: int, w: int) -> int:
    """The first finite point at the new level: within half a window either side of the onset
    (a median moves late or early on a decaying step), where the mean of the points after most
    exceeds the mean of those before."""
    r = min(w, REFINE_POINTS) * block
    reach = (w // 2 + 1) * block
    lo = max(s.onset * block - reach, r)
    hi = min(s.onset * block + reach, len(v) - r)
    if hi <= lo:
        return s.onset * block
    sums = np.concatenate(([0.0], np.cumsum(v[lo - r : hi + r] - v[lo])))
    j = np.arange(r, hi - lo + r + 1)
    gain = (sums[j + r] - sums[j]) - (sums[j] - sums[j - r])
    return lo + int(np.argmax(gain))


def _event(
    steps: np.ndarray,
    v: np.ndarray,
    u: np.ndarray,
    block: int,
    idx: np.ndarray,
    first: int,
    s: _Shift,
    span: int,
    restart: bool,
) -> Event:
    """The `level_shift` event of one shift, with how long the loss stayed up."""
    mid = 0.5 * (s.before + s.after)
    # it lasts until the median of half a window from a (reduced) point falls back under the
    # midpoint of the step
    rest = v[first:]
    after = u[min(first // block, len(u) - 1) :]
    r = min(max(span // block // 2, MIN_POINTS), len(after))
    back = np.flatnonzero(rolling_median(after, r) <= mid)
    held = min(int(back[0]) * block + 1, len(rest)) if len(back) else len(rest)
    still_up = not len(back)
    last = first + held - 1
    step, last_step = int(steps[idx[first]]), int(steps[idx[last]])
    # a log printed coarsely repeats values by itself: frozen only where the points before did not
    frozen = _frozen(rest[:held]) if _frozen(v[max(first - 4 * span, 0) : first]) is None else None
    multiplied = s.after >= MULTIPLIED * s.before > 0
    shift = s.after - s.before
    where = "at a restart the log shows, " if restart else ""
    stay = (
        f"up to the end of the log ({held} points, steps {step}..{last_step})"
        if still_up
        else f"for {held} points (steps {step}..{last_step}) before it came back"
    )
    message = (
        f"loss level shift: {where}the loss stepped up from {fmt(s.before)} to {fmt(s.after)} "
        f"(+{fmt(shift)}, {s.after / s.before:.2f}x, {shift / s.noise:.1f} noise SDs of a point"
        if s.noise > 0
        else f"loss level shift: {where}the loss stepped up from {fmt(s.before)} to "
        f"{fmt(s.after)} (+{fmt(shift)}, {s.after / s.before:.2f}x"
    )
    message += f") and stayed {stay}"
    if frozen:
        message += f"; it froze at {fmt(float(rest[frozen[0]]))}, a dead run"
    if multiplied:
        message += "; the loss multiplied: a failed run at any length"
    metrics = {
        "shift": float(shift),
        "ratio": float(s.after / s.before),
        "level_before": s.before,
        "level_after": s.after,
        "noise": s.noise,
        "shift_sigmas": float(shift / s.noise) if s.noise > 0 else None,
        "z": float(s.z) if math.isfinite(s.z) else None,
        "points": held,
        "steps": last_step - step + 1,
        "last_step": last_step,
        "still_up": still_up,
        "at_restart": restart,
        "frozen": bool(frozen),
        "window_points": span,
        "loss": float(v[first]),
    }
    severity: Severity = "critical" if multiplied or frozen else "warning"
    return Event(step, "level_shift", severity, message, metrics)


def _frozen(values: np.ndarray) -> tuple[int, int] | None:
    """Where the loss first holds one exact value on `FROZEN_POINTS` points in a row (the first
    of them, and how many), or None."""
    if len(values) < FROZEN_POINTS:
        return None
    same = np.concatenate(([0], (values[1:] == values[:-1]).astype(np.int8), [0]))
    edges = np.diff(same)
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    long = np.flatnonzero(ends - starts + 1 >= FROZEN_POINTS)
    if not len(long):
        return None
    k = int(long[0])
    return int(starts[k]), int(ends[k] - starts[k] + 1)
