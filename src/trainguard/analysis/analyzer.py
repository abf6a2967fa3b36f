"""`analyze`: run the detectors over a log offline and judge it."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from trainguard.analysis.logs import LogData
from trainguard.analysis.side_columns import COUNT_COLUMNS, side_column_counts, side_column_nans
from trainguard.config import DivergenceConfig, GuardConfig
from trainguard.detectors import DetectorSuite
from trainguard.detectors.level_shift import level_shifts, restarts_of
from trainguard.detectors.nonfinite import inferred_overflow
from trainguard.detectors.series import MetricSeries, true_runs
from trainguard.detectors.stats import WARM_RESTART, noise_and_drift
from trainguard.events import SEVERITY_RANK, SPIKE_TYPES, Event, Severity, SpikeType

SPIKE_WINDOW = 128
SPIKE_SIGMAS = 6.0
RECENT_STEPS = 10_000
RISE_POINTS = 3  # points in a row a sparse log's loss must rise for (see `sparse_rises`)
RISE_HISTORY = 5  # points before a rise that set its lowest loss and its noise
SPARSE_SHARE = 4  # a sparse log's trend windows span this share (1/4) of its points...
SPARSE_MOST = 2  # ...and at most this many times the detector's least window
ACTIONS = ("step", "skip", "rollback", "halt")


def spike_score(
    values: np.ndarray, window: int = SPIKE_WINDOW, sigmas: float = SPIKE_SIGMAS
) -> float:
    """OLMo-core's spike score: the fraction of points more than `sigmas` standard deviations
    above the mean of the `window` points before them."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) <= window:
        return 0.0
    hits = 0
    for s in range(window, len(v), 1 << 16):  # running sums per chunk, centred to stay exact
        part = v[s - window : s + (1 << 16)]
        centred = part - part.mean()
        sums = np.concatenate(([0.0], np.cumsum(centred)))
        squares = np.concatenate(([0.0], np.cumsum(centred * centred)))
        mean = (sums[window:-1] - sums[: -window - 1]) / window
        var = (squares[window:-1] - squares[: -window - 1]) / window - mean * mean
        std = np.sqrt(np.maximum(var, 0.0))
        hits += int(np.count_nonzero(centred[window:] > mean + sigmas * std))
    return hits / (len(v) - window)


@dataclass
class Analysis:
    """The events over a log: those a guarded run recorded (`recorded`, from its events.jsonl)
    and those the detectors raised offline, in step order; and a summary of the run."""

    events: list[Event]
    summary: dict[str, Any] = field(default_factory=dict)
    recorded: list[Event] = field(default_factory=list)

    @property
    def incidents(self) -> list[Event]:
        """Events at warning or above, but for how many snapshots fit: the run's set-up."""
        return [
            e
            for e in self.events
            if SEVERITY_RANK[e.severity] >= SEVERITY_RANK["warning"] and e.kind != "snapshot"
        ]

    def source(self, event: Event) -> str:
        """ "run" for an event the guarded run recorded, "analyze" for one found offline."""
        return "run" if any(event is e for e in self.recorded) else "analyze"

    def to_dict(self) -> dict[str, Any]:
        keys = ("step", "kind", "severity", "type", "message", "metrics")
        return {
            "events": [
                {**{k: e.to_dict()[k] for k in keys}, "source": self.source(e)} for e in self.events
            ],
            "summary": _json_safe(self.summary),
        }


def _json_safe(value: Any) -> Any:
    """The summary with its non-finite numbers as None, so that it stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def analyze(data: LogData, config: GuardConfig | None = None) -> Analysis:
    """The same detectors as a live run over the logged steps, their trend windows scaled to
    the points the log has (`scaled_config`); quiet stretches are taken in bulk
    (`DetectorSuite.run`), with the same events as step by step. Each stretch of NaN/Inf loss
    is one critical `nonfinite` event, on the final timeline and on the steps a rollback
    abandoned; a persistent step up of the loss level is a `level_shift` (`level_shifts`, with a
    lower bar at a restart the log shows), and a NaN grad norm beside a finite loss a `nonfinite`
    warning (`side_column_nans`), as is a rise of a count of skipped iterations (a critical one
    for NaN iterations, `side_column_counts`); the events a guarded run recorded
    (`data.recorded`) come along, and a detector's event at the step and of the kind of a
    recorded one is left out as the same incident."""
    given = config or GuardConfig()
    cfg = scaled_config(given, data.steps, data.loss)
    suite = DetectorSuite(cfg)
    full = data.series()
    full.overflow = inferred_overflow(full.loss, full.grad_norm)
    series, lengths = _first_of_each_nan_stretch(full)
    found = _windows_in_steps(_one_per_stretch(suite.run(series), series.steps, lengths), cfg, data)
    found = graded_by_response(found)
    found += _abandoned_nonfinite(data.abandoned)
    if _is_sparse(given.divergence, data.steps):
        found += sparse_rises(data.steps, data.loss, cfg.divergence, data.extra.get("lr"))
    restarts = restarts_of(data.abandoned.get("step"))
    found += level_shifts(data.steps, data.loss, data.extra.get("lr"), restarts)
    by_grad_norm = side_column_nans(
        data.steps, data.loss, data.extra.get("grad_norm"), data.extra.get("loss_scale")
    )
    counts = {k: v for k, v in data.extra.items() if k in COUNT_COLUMNS}
    found += by_grad_norm + side_column_counts(
        data.steps, data.loss, counts, data.extra.get("loss_scale"), by_grad_norm
    )
    recorded = [_event(r) for r in data.recorded or []]
    seen = {(e.step, e.kind) for e in recorded}
    events = sorted(
        recorded + [e for e in found if (e.step, e.kind) not in seen], key=lambda e: e.step
    )
    finite = data.loss[np.isfinite(data.loss)]
    grad = data.extra.get("grad_norm")
    summary: dict[str, Any] = {
        "steps": len(data.steps),
        "first_step": int(data.steps[0]),
        "last_step": int(data.steps[-1]),
        "by_kind": dict(Counter(e.kind for e in events)),
        "spike_score": {
            "loss": spike_score(finite),
            "loss_last_10k": spike_score(finite[-RECENT_STEPS:]),
        },
        "final_loss": float(finite[-1]) if len(finite) else None,
        "ends_nonfinite": bool(len(data.loss) and not np.isfinite(data.loss[-1])),
        "nonfinite_steps": int(len(data.loss) - len(finite)),
        "abandoned_steps": len(data.abandoned.get("step", ())),
        "recorded_events": len(recorded),
        "windows": {
            "stall": cfg.stall.window,
            "divergence": cfg.divergence.window,
            "oscillation": cfg.oscillation.window,
        },
        "warnings": data.warnings,
    }
    if grad is not None:
        ok = grad[np.isfinite(grad)]
        summary["spike_score"]["grad_norm"] = spike_score(ok)
        summary["spike_score"]["grad_norm_last_10k"] = spike_score(ok[-RECENT_STEPS:])
    result = Analysis(events, summary, recorded)
    summary["incidents"] = len(result.incidents)
    return result


def graded_by_response(events: list[Event]) -> list[Event]:
    """A log's whole story: a gradient incident the loss did not follow (its `grad_response`
    says a benign outlier) is info, the grading's words added to it; a confirming grading stays
    as the info event it is."""
    benign = {
        (e.metrics.get("spike_step"), e.metrics.get("spike_kind")): e
        for e in events
        if e.kind == "grad_response" and e.metrics.get("loss_responded") is False
    }
    out = []
    for e in events:
        grading = benign.get((e.step, e.kind))
        if grading is not None:
            e = dataclasses.replace(e, severity="info", message=f"{e.message}; {grading.message}")
        elif e.kind == "grad_response" and e.metrics.get("loss_responded") is False:
            continue  # told on its incident
        out.append(e)
    return out


def scaled_config(config: GuardConfig, steps: np.ndarray, loss: np.ndarray) -> GuardConfig:
    """`config` with the trend windows (stall, divergence, oscillation; set in steps) turned into
    the points of this log: a window of W steps spans W / spacing points, where the spacing is
    the median step between logged points; a log too sparse for that (fewer points than the
    detector's least window) is judged over the last quarter of its points, at most twice the
    least window; and no window is
    longer than half the log, so that a short log is judged too. Noise windows (loss and grad
    spikes) count points and are left as they are."""
    n = int(np.count_nonzero(np.isfinite(loss)))
    spacing = float(np.median(np.diff(steps))) if len(steps) > 1 else 1.0
    spacing = max(spacing, 1.0)

    def points(window: int, least: int) -> int:
        p = round(window / spacing)
        if p < least:
            p = max(least, min(n // SPARSE_SHARE, SPARSE_MOST * least))
        return max(least, min(p, n // 2))

    # the least windows the configs allow (20, 20, 32); at least one point per block, and three
    # per divergence block, whose losses' spread is its noise (`trends._median_noise`)
    stall = max(config.stall.blocks, 20)
    divergence = 3 * max(config.divergence.blocks, 20)
    return config.model_copy(
        update={
            "stall": config.stall.model_copy(update={"window": points(config.stall.window, stall)}),
            "divergence": config.divergence.model_copy(
                update={"window": points(config.divergence.window, divergence)}
            ),
            "oscillation": config.oscillation.model_copy(
                update={"window": points(config.oscillation.window, 32)}
            ),
        }
    )


def _windows_in_steps(events: list[Event], cfg: GuardConfig, data: LogData) -> list[Event]:
    """Stall and divergence messages that name their window in logged points and the steps
    those span, where the window was scaled to the log's spacing (`scaled_config`)."""
    windows = {
        "stall": (cfg.stall.window, cfg.stall.blocks),
        "divergence": (cfg.divergence.window, cfg.divergence.blocks),
    }
    if len(data.steps) < 2 or float(np.median(np.diff(data.steps))) <= 1.0:
        return events  # a point a step: the window's points are its steps
    judged = data.steps[np.isfinite(data.loss)]  # the detectors pass over NaN/Inf rows
    out = []
    for e in events:
        window, blocks = windows.get(e.kind, (None, 1))
        said = f"over the last {window} steps"
        if window is not None and said in e.message and len(judged):
            points = blocks * max(window // blocks, 1)  # whole blocks: what was judged
            at = int(np.searchsorted(judged, e.step))
            first = int(judged[max(at - points + 1, 0)])
            told = f"over the last {points} logged points (steps {first}..{e.step})"
            e = dataclasses.replace(e, message=e.message.replace(said, told))
        out.append(e)
    return out


def _is_sparse(cfg: DivergenceConfig, steps: np.ndarray) -> bool:
    """Whether a log is so sparse that `RISE_POINTS` of its points span the whole divergence
    window (in steps): there a rise of a few points is a rise of many steps (a point a day). A
    log a point every 50 steps has hundreds of points for the trend test, and three of its
    points rising in a row are a blip of 100 steps, which a heavy-tailed loss makes often."""
    if len(steps) < 2:
        return False
    spacing = float(np.median(np.diff(steps)))
    return spacing > 0 and spacing * (RISE_POINTS - 1) >= cfg.window


def sparse_rises(
    steps: np.ndarray,
    loss: np.ndarray,
    cfg: DivergenceConfig,
    lr: np.ndarray | None = None,
) -> list[Event]:
    """Divergence in a sparse log (a point a day, say), where a few points are days of training
    and a trend test has too few of them: the loss rose on `RISE_POINTS` points in a row, each
    more than `z_threshold` noise standard deviations over the level before them (the median of
    the `RISE_HISTORY` points before; the noise from the differences of the points before it),
    so the rise is sustained and not one jump or a noisy log's swing, the last `min_rel_rise`
    over that level, and the LR did not jump (a warm restart). One event per rise, until the
    loss falls back under `min_rel_rise` over the level."""
    ok = np.isfinite(loss)
    idx = np.flatnonzero(ok)
    v = loss[ok]
    k = RISE_POINTS
    events: list[Event] = []
    first_j = RISE_HISTORY + k - 1
    if len(v) <= first_j:
        return events
    # the cheap tests, vectorised: k rises in a row, the last min_rel_rise over the level
    up = np.diff(v) > 0
    rising: np.ndarray = np.asarray(sliding_window_view(up, k).all(axis=1))
    steady = rising[first_j - k :]  # k rises in a row ending at each j
    levels = np.median(sliding_window_view(v, RISE_HISTORY), axis=1)[: len(v) - first_j]
    ends, starts = v[first_j:], v[first_j - k + 1 : len(v) - k + 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.abs(levels)
        hit = steady & (scale > 0) & ((ends - levels) / scale >= cfg.min_rel_rise)
        hit &= starts > levels  # each point over the level: judged against the noise below
    active_level: float | None = None
    last_j = -1
    for j in (first_j + np.flatnonzero(hit)).tolist():
        if active_level is not None:  # one event per rise: re-armed once the loss fell back
            back = v[last_j + 1 : j + 1] < (1 + cfg.min_rel_rise) * active_level
            if not back.any():
                continue
            active_level = None
        before, window = v[: j - k + 1], v[j - k + 1 : j + 1]
        level = float(np.median(before[-RISE_HISTORY:]))
        noise, _ = noise_and_drift(before[-4 * RISE_HISTORY :].tolist())
        if float(window.min()) - level <= cfg.z_threshold * noise:
            continue  # not every point of the rise is clear of the noise
        if lr is not None:
            rates = lr[idx[j - k] : idx[j] + 1]
            rates = rates[np.isfinite(rates)]
            if len(rates) > 1 and bool(np.any(rates[1:] > WARM_RESTART * rates[:-1])):
                continue
        active_level, last_j = level, j
        rise = (window[-1] - level) / abs(level)
        first = int(steps[idx[j - k + 1]])
        message = (
            f"loss diverging: it rose on {k} logged points in a row (steps {first}.."
            f"{int(steps[idx[j]])}), {rise:.1%} above its level {level:.4g} before them, now "
            f"{window[-1]:.4g}; the log is too sparse for the trend test, so each point of the "
            "rise is judged against the noise of the points before it"
        )
        metrics = {
            "rise": rise,
            "level": level,
            "latest": float(window[-1]),
            "points": k,
            "from_step": first,
            "noise": noise,
        }
        events.append(Event(int(steps[idx[j]]), "divergence", "critical", message, metrics))
    return events


def _first_of_each_nan_stretch(
    series: MetricSeries,
) -> tuple[MetricSeries, dict[int, tuple[int, int]]]:
    """The series with each stretch of NaN/Inf loss cut to its first row (a run that died
    stays dead: its later rows add no event, and the detectors would take them one by one),
    and, by the step of each such first row, the last step and length of its stretch."""
    bad = ~np.isfinite(series.loss)
    if not bad.any():
        return series, {}
    runs = true_runs(bad)
    steps = series.steps
    lengths = {int(steps[a]): (int(steps[b]), b - a + 1) for a, b in runs}
    keep = ~bad
    keep[[a for a, _ in runs]] = True

    def cut(column: np.ndarray | None) -> np.ndarray | None:
        return None if column is None else column[keep]

    return (
        MetricSeries(
            steps[keep],
            series.loss[keep],
            grad_norm=cut(series.grad_norm),
            lr=cut(series.lr),
            loss_scale=cut(series.loss_scale),
            overflow=cut(series.overflow),
            token_accuracy=cut(series.token_accuracy),
            evals=series.evals,
            precursors=(
                [p for p, k in zip(series.precursors, keep, strict=True) if k]
                if series.precursors is not None
                else None
            ),
        ),
        lengths,
    )


def _one_per_stretch(
    events: list[Event], steps: np.ndarray, lengths: dict[int, tuple[int, int]]
) -> list[Event]:
    """The detectors' events with each run of `nonfinite` events on consecutive rows of `steps`
    folded into its first, which then names the stretch (last step, how many steps); a row
    that stands for a cut stretch of NaN/Inf loss (`lengths`) counts as that whole stretch."""
    out: list[Event] = []
    head: Event | None = None
    last = -2
    for e in events:
        if e.kind != "nonfinite":
            out.append(e)
            continue
        at = int(np.searchsorted(steps, e.step))  # its row: the steps are sorted and unique
        end, count = lengths.get(e.step, (e.step, 1))
        if head is not None and at == last + 1:
            head.metrics["last_step"] = end
            head.metrics["steps"] += count
        else:
            head = e
            e.metrics = {**e.metrics, "first_step": e.step, "last_step": end, "steps": count}
            out.append(e)
        if head.metrics["steps"] > 1:
            head.message = _stretch_message(head)
        last = at
    return out


def _stretch_message(event: Event) -> str:
    first = event.message.split(" (on ", 1)[0]
    m = event.metrics
    return f"{first} (on {m['steps']} logged steps in a row, {m['first_step']}..{m['last_step']})"


def _abandoned_nonfinite(abandoned: dict[str, np.ndarray]) -> list[Event]:
    """A critical `nonfinite` event for each stretch of NaN/Inf loss among the rows a later row
    of the same step replaced (the steps a rollback abandoned and replayed)."""
    steps, loss = abandoned.get("step"), abandoned.get("loss")
    if steps is None or loss is None or not len(steps):
        return []
    bad = ~np.isfinite(loss)
    events: list[Event] = []
    i = 0
    while i < len(bad):
        if not bad[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(bad) and bad[j + 1]:
            j += 1
        first, last = int(steps[i]), int(steps[j])
        count = j - i + 1
        message = (
            f"the loss is {loss[i]} on {count} step(s) ({first}..{last}) that a rollback "
            "abandoned: the run replayed them later, and the log's final timeline hides them"
        )
        metrics = {"loss": float(loss[i]), "first_step": first, "last_step": last, "steps": count}
        events.append(Event(first, "nonfinite", "critical", message, metrics))
        i = j + 1
    return events


def _event(record: dict[str, Any]) -> Event:
    """An Event of a line of events.jsonl (already checked to be one: a string kind, an integer
    step, a known severity, metrics that are an object)."""
    spike_type = record.get("type")
    action = record.get("action")
    confidence = record.get("confidence")
    return Event(
        step=int(record["step"]),
        kind=str(record["kind"]),
        severity=cast(Severity, record.get("severity", "info")),
        message=str(record.get("message", "")),
        metrics=dict(record.get("metrics") or {}),
        type=cast(SpikeType, spike_type) if spike_type in SPIKE_TYPES else None,
        confidence=float(confidence)
        if isinstance(confidence, (int, float)) and not isinstance(confidence, bool)
        else None,
        action=action if action in ACTIONS else None,
        time=str(record.get("time", "")),
        rank=record["rank"] if isinstance(record.get("rank"), int) else None,
    )
