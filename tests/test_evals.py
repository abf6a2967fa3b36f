"""Evaluations (`guard.evaluate`): forgetting (`eval_decline`), the input checks, their records,
the offline path (`analyze` of logs with evaluation columns) and token accuracy."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from trainguard import GuardConfig
from trainguard.config import EvalDeclineConfig, TokenAccuracyConfig
from trainguard.detectors import DetectorSuite, MetricPoint
from trainguard.detectors.base import EvalPoint, higher_is_better
from trainguard.detectors.evals import EvalDeclineDetector
from trainguard.detectors.series import MetricSeries
from trainguard.detectors.token_accuracy import TokenAccuracyDetector
from trainguard.events import Event, TrainguardError
from trainguard.monitor import Monitor
from trainguard.sinks import Sink, load_schema

EVERY = 50  # steps between evaluations


def curves(
    seed: int = 0,
    steps: int = 3000,
    turn: int | None = 1500,
    eval_noise: float = 0.004,
    rise: float = 0.4,
    train_rises: bool = False,
) -> tuple[np.ndarray, np.ndarray, list[tuple[int, float]]]:
    """A run whose training loss falls (or rises from `turn` on, `train_rises`) and whose
    validation loss improves, then from `turn` rises by `rise` over the rest (forgetting); no
    turn: it improves throughout."""
    rng = np.random.default_rng(seed)
    s = np.arange(steps)
    train = 2.0 + 2.0 * np.exp(-s / 600) + rng.normal(0, 0.03, steps)
    if train_rises and turn is not None:
        train = train + np.where(s > turn, 0.6 * (s - turn) / (steps - turn), 0.0)
    evals = []
    for k in range(EVERY, steps + 1, EVERY):
        v = 2.3 + 1.8 * math.exp(-k / 400)
        if turn is not None and k > turn:
            v += rise * (k - turn) / (steps - turn)
        evals.append((k, v + float(rng.normal(0, eval_noise))))
    return s, train, evals


def live(
    steps: np.ndarray,
    train: np.ndarray,
    evals: list[tuple[int, float]],
    name: str = "val_loss",
    config: GuardConfig | None = None,
    **kwargs: Any,
) -> list[Event]:
    """The events a Monitor raises over a run fed live."""
    found: list[Event] = []
    with Monitor(config or GuardConfig(console=False), **kwargs) as monitor:
        pending = list(evals)
        for step, loss in zip(steps.tolist(), train.tolist(), strict=True):
            found += monitor.observe(step, loss=loss).events
            while pending and pending[0][0] <= step:
                at, value = pending.pop(0)
                found += monitor.evaluate(at, {name: value})
        for at, value in pending:
            found += monitor.evaluate(at, {name: value})
    return [e for e in found if e.kind != "run_closed"]


def declines(events: list[Event]) -> list[Event]:
    return [e for e in events if e.kind == "eval_decline"]


def test_forgetting_warns_once_soon_after_the_eval_turns_while_the_train_loss_falls():
    steps, train, evals = curves()
    found = declines(live(steps, train, evals))
    assert len(found) == 1, [e.message for e in found]
    event = found[0]
    assert event.severity == "warning" and event.action is None
    assert 1500 < event.step <= 1900  # its best is at 1500; 1% worse about 5 evaluations on
    assert event.metrics["train_loss_now"] < event.metrics["train_loss_best"]
    assert event.metrics["current"] > event.metrics["best"]
    assert "forgetting" in event.message and "cooldown on high-quality data" in event.message
    assert "lower the LR" in event.message


@pytest.mark.parametrize("seed", range(6))
def test_a_noisy_flat_eval_does_not_warn(seed):
    rng = np.random.default_rng(100 + seed)
    steps, train, _ = curves(seed)
    evals = [(k, 2.5 + float(rng.normal(0, 0.02))) for k in range(EVERY, 3001, EVERY)]
    assert declines(live(steps, train, evals)) == []


@pytest.mark.parametrize("seed", range(4))
def test_an_improving_eval_does_not_warn(seed):
    steps, train, evals = curves(seed, turn=None, eval_noise=0.01)
    assert declines(live(steps, train, evals)) == []


def test_an_eval_rising_with_the_train_loss_is_divergence_not_forgetting():
    steps, train, evals = curves(train_rises=True)
    assert declines(live(steps, train, evals)) == []


def test_a_falling_accuracy_is_a_decline_and_a_rising_one_is_not():
    steps, train, evals = curves()
    accuracy = [(k, 1.0 - v / 5) for k, v in evals]  # falls from 1500 on
    found = declines(live(steps, train, accuracy, name="mmlu"))
    assert len(found) == 1 and found[0].metrics["higher_is_better"] is True
    assert found[0].metrics["current"] < found[0].metrics["best"]
    _, _, improving = curves(turn=None)
    rising = [(k, 1.0 - v / 5) for k, v in improving]
    assert declines(live(steps, train, rising, name="mmlu")) == []


def test_the_direction_comes_from_the_name():
    for name in ("val_loss", "eval_loss", "eval/perplexity", "val_ppl", "wer", "eval_nll"):
        assert not higher_is_better(name), name
    for name in ("mmlu", "eval_accuracy", "bleu", "rouge1", "f1", "exact_match", "val/acc"):
        assert higher_is_better(name), name


def test_a_warning_per_episode_and_again_after_a_recovery():
    detector = EvalDeclineDetector(EvalDeclineConfig())
    values = [2.6, 2.58, 2.555, 2.54, 2.53, 2.52, 2.515, 2.51, 2.505, 2.6, 2.62, 2.64, 2.65]
    values += [2.5, 2.49, 2.495, 2.49, 2.485, 2.48, 2.6, 2.66, 2.7, 2.75]
    raised = []
    for k, value in enumerate(values):
        detector.update(MetricPoint(step=k * 10, loss=5.0 - 0.1 * k))
        raised += [k for _ in detector.evaluate(EvalPoint.of(k * 10 + 10, "val_loss", value))]
    assert raised[0] == 10 and len(raised) == 2 and raised[1] >= 20, raised  # after a recovery


def test_bad_evaluations_are_one_line_errors(tmp_path):
    with Monitor(GuardConfig(console=False), run_dir=tmp_path) as monitor:
        bad: list[tuple[Any, Any, str]] = [
            (10, {"mmlu": "high"}, "not a number"),
            (10, {"mmlu": None}, "not a number"),
            (10, {"mmlu": True}, "not a number"),
            (10, {"mmlu": torch.ones(3)}, "not a number"),
            (10, {}, "no evaluations given"),
            (10, [("mmlu", 0.4)], "takes a mapping"),
            (10, {"": 0.4}, "non-empty string"),
            (-1, {"mmlu": 0.4}, "negative"),
            (2.5, {"mmlu": 0.4}, "whole number"),
        ]
        for step, values, said in bad:
            with pytest.raises(TrainguardError) as caught:
                monitor.evaluate(step, values)
            assert said in str(caught.value) and "\n" not in str(caught.value)
        monitor.evaluate(20, {"mmlu": 0.4, "val_loss": torch.tensor(2.0), "bpb": np.float32(1)})
        monitor.evaluate(20, {"hellaswag": 0.3})  # another evaluation at the same step
        with pytest.raises(TrainguardError, match="must not go back"):
            monitor.evaluate(10, {"mmlu": 0.4})
    (line, second) = [json.loads(x) for x in (tmp_path / "evals.jsonl").read_text().splitlines()]
    assert line["step"] == 20 and line["values"] == {"mmlu": 0.4, "val_loss": 2.0, "bpb": 1.0}
    assert second["values"] == {"hellaswag": 0.3}
    # the last evaluation's step carries over a checkpoint: a resumed run refuses going back
    state = json.loads(json.dumps(monitor.state_dict()))
    with Monitor(GuardConfig(console=False), run_dir=tmp_path / "resumed") as resumed:
        resumed.load_state_dict(state)
        with pytest.raises(TrainguardError, match="must not go back"):
            resumed.evaluate(10, {"mmlu": 0.4})


def test_a_nan_evaluation_is_its_own_warning_once_until_a_finite_one(tmp_path):
    with Monitor(GuardConfig(console=False), run_dir=tmp_path) as monitor:
        first = monitor.evaluate(10, {"val_loss": math.nan})
        again = monitor.evaluate(20, {"val_loss": math.inf})
        monitor.evaluate(30, {"val_loss": 2.0})
        after = monitor.evaluate(40, {"val_loss": math.nan})
    assert [e.kind for e in first] == ["eval_decline"] and "not finite" in first[0].message
    assert again == [] and len(after) == 1
    lines = [json.loads(x) for x in (tmp_path / "evals.jsonl").read_text().splitlines()]
    assert lines[0]["values"] == {"val_loss": "nan"}
    for line in lines:
        jsonschema.validate(line, load_schema("evals"))
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "eval_decline"] == [10, 40]


class Collecting(Sink):
    def __init__(self) -> None:
        self.evaluations: list[dict[str, Any]] = []
        self.events: list[Event] = []

    def on_evaluation(self, record: dict[str, Any]) -> None:
        self.evaluations.append(record)

    def on_event(self, event: Event) -> None:
        self.events.append(event)


def test_sinks_get_each_evaluation_and_its_events_and_the_state_round_trips(tmp_path):
    steps, train, evals = curves()
    sink = Collecting()
    found = live(steps, train, evals, run_dir=tmp_path, sinks=[sink])
    assert len(sink.evaluations) == len(evals)
    assert sink.evaluations[0]["values"] == {"val_loss": evals[0][1]}
    assert [e.kind for e in sink.events if e.kind == "eval_decline"] == ["eval_decline"]
    assert declines(found)[0].step in [r["step"] for r in sink.evaluations]
    # the detector's state (plain data) carries over a checkpoint
    detector = EvalDeclineDetector()
    for k, v in evals[:20]:
        detector.update(MetricPoint(step=k - 1, loss=3.0 - k / 1e4))
        detector.evaluate(EvalPoint.of(k, "val_loss", v))
    state = json.loads(json.dumps(detector.state_dict()))
    copy = EvalDeclineDetector()
    copy.load_state_dict(state)
    for k, v in evals[20:]:
        point = MetricPoint(step=k - 1, loss=3.0 - k / 1e4)
        detector.update(point)
        copy.update(point)
        a = detector.evaluate(EvalPoint.of(k, "val_loss", v))
        b = copy.evaluate(EvalPoint.of(k, "val_loss", v))
        assert [e.message for e in a] == [e.message for e in b]


def series_of(steps: np.ndarray, train: np.ndarray, evals: list[tuple[int, float]], name: str):
    return MetricSeries(
        steps.astype(np.int64),
        train.astype(np.float64),
        evals=[EvalPoint.of(k, name, v) for k, v in evals],
    )


@pytest.mark.parametrize("train_rises", [False, True])
def test_the_bulk_run_raises_what_the_live_path_raises_in_the_same_order(train_rises):
    steps, train, evals = curves(train_rises=train_rises)
    train[2200] = 40.0  # a loss spike among the evaluations
    config = GuardConfig(console=False)
    expected = live(steps, train, evals, config=config)
    found = DetectorSuite(config).run(series_of(steps, train, evals, "val_loss"))
    assert [(e.step, e.kind, e.message) for e in found] == [
        (e.step, e.kind, e.message) for e in expected
    ]
    assert any(e.kind == "loss_spike" for e in found)


def test_the_rollback_of_a_replayed_timeline_lets_evaluation_steps_go_back(tmp_path):
    with Monitor(GuardConfig(console=False), run_dir=tmp_path) as monitor:
        monitor.evaluate(100, {"val_loss": 2.0})
        monitor.policy.forget_after(50)  # what a rollback to step 50 does
        monitor.evaluate(80, {"val_loss": 2.1})
        with pytest.raises(TrainguardError):
            monitor.evaluate(40, {"val_loss": 2.1})


# -- token accuracy ----------------------------------------------------------------------------


def accuracy_points(values: list[float], every: int = 10) -> list[MetricPoint]:
    return [MetricPoint(step=k * every, loss=2.0, token_accuracy=v) for k, v in enumerate(values)]


def test_token_accuracy_under_its_healthy_range_is_one_info_event_per_episode():
    rng = np.random.default_rng(0)
    healthy = (0.55 + 0.05 * np.linspace(0, 1, 60) + rng.normal(0, 0.004, 60)).tolist()
    values = [*healthy, 0.42, 0.41, 0.43, *healthy[-10:], 0.4]
    detector = TokenAccuracyDetector(TokenAccuracyConfig())
    events = [e for p in accuracy_points(values) for e in detector.update(p)]
    assert [e.step for e in events] == [600, 730]
    assert all(e.kind == "token_accuracy" and e.severity == "info" for e in events)
    assert events[0].metrics["floor"] > 0.43 and "healthy range" in events[0].message


def test_noisy_healthy_token_accuracy_and_the_warmup_stay_quiet():
    rng = np.random.default_rng(1)
    values = [0.1, 0.05, *(0.6 + rng.normal(0, 0.01, 400)).tolist()]  # a first value is low
    detector = TokenAccuracyDetector()
    assert [e for p in accuracy_points(values) for e in detector.update(p)] == []


def test_a_lasting_lower_token_accuracy_becomes_the_range_after_one_event():
    values = [0.6] * 30 + [0.5] * 40 + [0.4]
    detector = TokenAccuracyDetector()
    events = [e for p in accuracy_points(values) for e in detector.update(p)]
    assert [e.step for e in events] == [300, 700]  # the drop, then a drop from the new level


def test_token_accuracy_bulk_run_matches_the_live_updates():
    rng = np.random.default_rng(2)
    n = 5000
    column = np.full(n, np.nan)
    column[::25] = 0.6 + rng.normal(0, 0.01, len(column[::25]))
    column[3000] = 0.3
    steps = np.arange(n)
    series = MetricSeries(steps, np.full(n, 2.0), token_accuracy=column)
    config = GuardConfig(console=False)
    found = [e for e in DetectorSuite(config).run(series) if e.kind == "token_accuracy"]
    detector = TokenAccuracyDetector(config.token_accuracy)
    expected = [e for i in range(n) for e in detector.update(series.point(i))]
    assert [e.step for e in found] == [e.step for e in expected] == [3000]


def test_analyze_reads_a_token_accuracy_column(tmp_path: Path):
    from trainguard.analysis.analyzer import analyze
    from trainguard.analysis.logs import read_log

    rng = np.random.default_rng(3)
    rows = ["step,loss,train/token_accuracy"]
    for s in range(400):
        accuracy = "" if s % 4 else f"{0.6 + rng.normal(0, 0.01) - (0.2 if s == 300 else 0):.4f}"
        rows.append(f"{s},{2.0 + rng.normal(0, 0.01):.4f},{accuracy}")
    log = tmp_path / "log.csv"
    log.write_text("\n".join(rows) + "\n")
    data = read_log(log)
    found = [e for e in analyze(data, GuardConfig(console=False)).events]
    assert [e.step for e in found if e.kind == "token_accuracy"] == [300]


# -- the offline path: logs with evaluation columns --------------------------------------------


def hf_state(path: Path, steps: np.ndarray, train: np.ndarray, evals: list[tuple[int, float]]):
    history: list[dict[str, Any]] = []
    pending = list(evals)
    for step, loss in zip(steps.tolist(), train.tolist(), strict=True):
        history.append({"step": step, "epoch": step / 1000, "loss": loss, "learning_rate": 1e-4})
        while pending and pending[0][0] <= step:
            at, value = pending.pop(0)
            history.append(
                {
                    "step": at,
                    "epoch": at / 1000,
                    "eval_loss": value,
                    "eval_accuracy": 1.0 - value / 5,
                    "eval_runtime": 1.5,
                    "eval_samples_per_second": 100.0,
                    "eval_steps_per_second": 10.0,
                }
            )
    path.write_text(json.dumps({"log_history": history, "global_step": int(steps[-1])}))


def test_analyze_of_a_trainer_state_finds_the_forgetting_the_live_path_finds(tmp_path):
    from trainguard.analysis.analyzer import analyze
    from trainguard.analysis.logs import read_log

    steps, train, evals = curves(seed=4)
    hf_state(tmp_path / "trainer_state.json", steps, train, evals)
    data = read_log(tmp_path / "trainer_state.json")
    assert list(data.evaluations) == ["eval_loss", "eval_accuracy"]  # not runtime, throughput
    offline = declines(analyze(data, GuardConfig(console=False)).events)
    found: list[Event] = []
    with Monitor(GuardConfig(console=False)) as monitor:
        pending = list(evals)
        for step, loss in zip(steps.tolist(), train.tolist(), strict=True):
            monitor.observe(step, loss=loss)
            while pending and pending[0][0] <= step:
                at, value = pending.pop(0)
                found += monitor.evaluate(at, {"eval_loss": value, "eval_accuracy": 1 - value / 5})
    assert len(found) == 2 and {e.metrics["name"] for e in found} == {"eval_loss", "eval_accuracy"}
    assert [(e.step, e.message) for e in offline] == [(e.step, e.message) for e in declines(found)]


def test_analyze_of_a_lightning_csv_and_of_a_guarded_run_folder_find_the_same(tmp_path):
    from trainguard.analysis.analyzer import analyze
    from trainguard.analysis.logs import read_log

    steps, train, evals = curves(seed=5)
    rows = ["epoch,step,train_loss,val_loss,val_acc"]
    pending = list(evals)
    for step, loss in zip(steps.tolist(), train.tolist(), strict=True):
        rows.append(f"0,{step},{loss!r},,")
        while pending and pending[0][0] <= step:
            at, value = pending.pop(0)
            rows.append(f"0,{at},,{value!r},{1 - value / 5!r}")
    (tmp_path / "metrics.csv").write_text("\n".join(rows) + "\n")
    data = read_log(tmp_path / "metrics.csv")
    assert set(data.evaluations) == {"val_loss", "val_acc"} and not data.warnings
    offline = declines(analyze(data, GuardConfig(console=False)).events)
    run_dir = tmp_path / "run"
    expected = declines(live(steps, train, evals, run_dir=run_dir))
    assert [e.step for e in offline if e.metrics["name"] == "val_loss"] == [
        e.step for e in expected
    ]
    assert len(offline) == 2
    # the guarded run's folder: metrics.jsonl with evals.jsonl beside it
    again = read_log(run_dir / "metrics.jsonl")
    assert list(again.evaluations) == ["val_loss"]
    redone = declines(analyze(again, GuardConfig(console=False)).events)
    assert [(e.step, e.message) for e in redone] == [(e.step, e.message) for e in expected]


def test_the_report_draws_a_panel_per_evaluation_with_the_decline_marked(tmp_path):
    from trainguard.analysis.run import load_run
    from trainguard.sinks.html_report import _curves, incidents_of

    steps, train, evals = curves(seed=6)
    run_dir = tmp_path / "run"
    names = [f"bench_{k}" for k in range(10)]  # ten evaluations: eight panels
    with Monitor(GuardConfig(console=False), run_dir=run_dir) as monitor:
        pending = list(evals)
        for step, loss in zip(steps.tolist(), train.tolist(), strict=True):
            monitor.observe(step, loss=loss)
            while pending and pending[0][0] <= step:
                at, value = pending.pop(0)
                monitor.evaluate(at, {"val_loss": value, **dict.fromkeys(names, 0.5)})
    record = load_run(run_dir)
    assert set(record.evals) == {"val_loss", *names}
    figure = _curves(record, incidents_of(record.events))
    panels = [t["name"] for t in figure["data"] if t.get("mode") == "lines+markers"]
    assert panels == ["val loss", *[n.replace("_", " ") for n in names[:7]]]
    (marker,) = [t for t in figure["data"] if t.get("name") == "eval decline"]
    event = next(e for e in record.events if e["kind"] == "eval_decline")
    assert marker["x"] == [event["step"]] and marker["y"] == [event["metrics"]["value"]]
    (curve,) = [t for t in figure["data"] if t.get("name") == "val loss"]
    assert marker["yaxis"] == curve["yaxis"] != "y"  # on the evaluation's panel, not the loss's
    # its card judges no outcome by the training loss (which falls, by the rule)
    from trainguard.sinks.html_report import _cards

    cards = _cards(record, incidents_of(record.events))
    assert "eval_decline" in cards and "<dt>outcome</dt>" not in cards


def test_the_console_tensorboard_and_prometheus_sinks_show_evaluations(tmp_path):
    import io
    import urllib.request

    from rich.console import Console

    from trainguard.sinks import ConsoleSink
    from trainguard.sinks.prometheus import PrometheusSink
    from trainguard.sinks.tensorboard import TensorBoardSink

    record = {"step": 40, "time": "t", "values": {"val_loss": 2.5, "mmlu": 0.4, "bad": "nan"}}
    out = io.StringIO()
    ConsoleSink(Console(file=out, width=200), min_severity="info").on_evaluation(record)
    assert "step 40 evaluation: val_loss 2.5, mmlu 0.4, bad nan" in out.getvalue()
    quiet = io.StringIO()
    ConsoleSink(Console(file=quiet, width=200)).on_evaluation(record)  # warnings only
    assert quiet.getvalue() == ""

    class Writer:
        def __init__(self, log_dir: str) -> None:
            self.scalars: list[tuple[str, float, int]] = []

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            self.scalars.append((tag, value, step))

        def close(self) -> None:
            pass

    board = TensorBoardSink(tmp_path, make_writer=Writer)
    board.on_evaluation(record)
    assert board.writer.scalars == [("eval/val_loss", 2.5, 40), ("eval/mmlu", 0.4, 40)]
    prometheus = PrometheusSink(0, addr="127.0.0.1")
    try:
        prometheus.on_evaluation(record)
        url = f"http://127.0.0.1:{prometheus.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as page:
            text = page.read().decode()
        assert 'trainguard_eval{name="val_loss"} 2.5' in text
        assert 'trainguard_eval{name="mmlu"} 0.4' in text and 'name="bad"' not in text
    finally:
        prometheus.close()


def test_wandb_csv_and_jsonl_logs_give_their_evaluation_columns(tmp_path):
    from trainguard.analysis.logs import read_log

    steps, train, evals = curves(seed=7, steps=600)
    at = dict(evals)
    rows = ["_step,_runtime,train/loss,eval/loss,eval/accuracy,eval/runtime"]
    lines = []
    for step, loss in zip(steps.tolist(), train.tolist(), strict=True):
        rows.append(f"{step},{step / 10},{loss!r},,,")
        lines.append(json.dumps({"step": step, "loss": loss}))
        if step in at:
            rows.append(f"{step},{step / 10},,{at[step]!r},{1 - at[step] / 5!r},1.5")
            lines.append(json.dumps({"step": step, "val/loss": at[step], "val/runtime": 2.0}))
    (tmp_path / "history.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "log.jsonl").write_text("\n".join(lines) + "\n")
    wandb = read_log(tmp_path / "history.csv")
    assert wandb.format == "wandb_csv" and set(wandb.evaluations) == {"eval/loss", "eval/accuracy"}
    assert wandb.evaluations["eval/loss"][1].tolist() == [v for k, v in evals if k < 600]
    generic = read_log(tmp_path / "log.jsonl")
    assert list(generic.evaluations) == ["val/loss"] and not generic.warnings
    assert generic.evaluations["val/loss"][0].tolist() == [k for k, _ in evals if k < 600]
    assert len(generic.steps) == 600  # the evaluation rows are not training rows


def test_a_trainer_state_with_an_accuracy_and_no_eval_loss_gives_it(tmp_path):
    from trainguard.analysis.logs import read_log

    history = [{"step": s, "loss": 2.0 - s / 100} for s in range(1, 40)]
    history += [{"step": s, "eval_accuracy": 0.5 + s / 1000, "epoch": 1.0} for s in (10, 20, 30)]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    data = read_log(tmp_path / "trainer_state.json")
    assert list(data.evaluations) == ["eval_accuracy"] and not data.evals
    assert data.evaluations["eval_accuracy"][0].tolist() == [10, 20, 30]


def test_per_class_metrics_never_crowd_out_the_evaluation_loss(tmp_path):
    """A token-classification log lists 20 per-tag metrics and their counts before eval_loss
    in each entry: the loss and the one-word metrics come first, counts are not evaluations."""
    from trainguard.analysis.logs import MAX_EVALUATIONS, read_log

    history: list[dict[str, Any]] = [{"step": s, "loss": 2.0 - s / 100} for s in range(1, 40)]
    for s in (10, 20, 30):
        entry: dict[str, Any] = {"step": s}
        for tag in range(20):
            entry[f"eval_T{tag:03d}_f1"] = 0.5
            entry[f"eval_T{tag:03d}_number"] = 12
        entry.update({"eval_loss": 1.0 + s / 100, "eval_f1": 0.6, "eval_runtime": 3.0})
        history.append(entry)
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    names = list(read_log(tmp_path / "trainer_state.json").evaluations)
    assert names[:2] == ["eval_loss", "eval_f1"] and len(names) == MAX_EVALUATIONS
    assert not any(n.endswith("_number") for n in names)


def test_a_detectors_evaluation_event_is_a_warning_at_most_and_never_an_action():
    from trainguard.detectors import Detector, register_detector, unregister_detector

    class AtChance(Detector):
        name = "test_at_chance"

        def update(self, point: MetricPoint) -> list[Event]:
            return []

        def evaluate(self, point: EvalPoint) -> list[Event]:
            if point.value > 0.3:
                return []
            return [Event(point.step, "eval_decline", "critical", "at chance", {})]

    register_detector(AtChance)
    try:
        with Monitor(GuardConfig(console=False)) as monitor:
            assert monitor.evaluate(5, {"mmlu": 0.5}) == []
            (event,) = monitor.evaluate(10, {"mmlu": 0.25})
            decision = monitor.observe(11, loss=2.0)
    finally:
        unregister_detector(AtChance)
    assert (event.severity, event.action, event.step) == ("warning", None, 10)
    assert decision.action == "step" and decision.events == []


def test_token_accuracy_passed_in_is_one_number_in_range_or_a_one_line_error(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(GuardConfig(console=False), run_dir=tmp_path / "m") as monitor:
        for bad in (torch.rand(3), 1.5, -0.1, "0.5", True):
            with pytest.raises(TrainguardError, match="token_accuracy=") as caught:
                monitor.observe(0, loss=2.0, token_accuracy=bad)  # type: ignore[arg-type]
            assert "\n" not in str(caught.value)
        monitor.observe(0, loss=2.0, token_accuracy=torch.tensor(0.4))
    from trainguard import Guard

    with Guard(model, opt, config=GuardConfig(console=False), run_dir=tmp_path / "g") as guard:
        model(torch.ones(1, 2)).sum().backward()
        with pytest.raises(TrainguardError, match="token_accuracy="):
            guard.step(torch.tensor(1.0), token_accuracy=torch.rand(3))
        assert guard.global_step == 0  # refused before anything was measured or stepped
        decision = guard.step(torch.tensor(1.0), token_accuracy=0.25)
        assert decision.action == "step"


def test_an_evaluation_at_a_future_step_does_not_lock_out_the_later_ones(tmp_path):
    """An epoch or sample count passed as the step by mistake is taken as given, and the next
    evaluations at the training's real steps are still accepted."""
    with Monitor(GuardConfig(console=False), run_dir=tmp_path) as monitor:
        for step in range(3):
            monitor.observe(step, loss=2.0)
        monitor.evaluate(10**6, {"val_loss": 2.0})
        monitor.evaluate(3, {"val_loss": 2.0})
        with pytest.raises(TrainguardError, match="must not go back"):
            monitor.evaluate(1, {"val_loss": 2.0})


def test_decline_shares_over_one_are_refused():
    for section, field in (("eval_decline", "min_rel_decline"), ("token_accuracy", "min_drop")):
        with pytest.raises(TrainguardError, match=f"{section}.{field}"):
            GuardConfig.from_dict({section: {field: 2}})
