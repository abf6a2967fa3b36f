"""Issue 16: bad input to any reader or subcommand is one line and exit 2, never a traceback.

The fixed cases are the classes of input the tester found. Hypothesis then fuzzes the readers
and every subcommand in this process (fast, many examples), and each subcommand a few times
through the installed console script, as a user runs it."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from trainguard.analysis import RunWatcher, load_run, read_log
from trainguard.analysis.logs import LogData
from trainguard.config import GuardConfig
from trainguard.events import EVENT_KINDS, TrainguardError
from trainguard.sinks.html_report import write_report

from helpers import Ran
from helpers import cli as run_in_process

EXE = shutil.which("trainguard", path=str(Path(sys.executable).parent))
FUZZ = settings(
    deadline=None,
    derandomize=True,  # the same examples on every run and machine
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
RANDOM_BYTES = np.random.default_rng(16).bytes(8192)
BIG_FIELD = 50 * 2**20  # the tester's 50 MB CSV field
HEALTHY_CSV = "step,loss\n" + "".join(f"{i},{3 - i / 100}\n" for i in range(60))
HEALTHY_METRICS = "".join(
    json.dumps({"step": i, "loss": 3 - i / 100, "grad_norm": 1.0}) + "\n" for i in range(60)
)
SPIKE = {
    "step": 30,
    "time": 0.0,
    "kind": "loss_spike",
    "severity": "warning",
    "type": "data_toxicity",
    "message": "loss 9 against 2.7",
    "metrics": {"loss": 9.0},
    "action": "skip",
}


def cli(*args: str | Path) -> Ran:
    """`trainguard ARGS` run in this process, with the environment's COLUMNS as it is."""
    return run_in_process(*args, columns=None)


def shell(*args: str | Path, prefix: Sequence[str] = ()) -> Ran:
    """`trainguard ARGS` run by the installed console script (after `prefix`, a command that
    runs it)."""
    assert EXE, "the trainguard console script is not installed in this environment"
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run(
        [*prefix, EXE, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    return Ran(done.returncode, done.stdout, done.stderr)


def check_clean(ran: Ran) -> None:
    """No traceback; exit 0, 1 or 2; on 2, one error line, last, that is not an internal error."""
    assert "Traceback" not in ran.out + ran.err, ran.err
    assert ran.code in (0, 1, 2), (ran.code, ran.err)
    if ran.code == 2:
        assert ran.err.rstrip().endswith(ran.error), ran.err
        assert "internal error" not in ran.error, ran.error


def expect_error(ran: Ran, fragment: str) -> None:
    check_clean(ran)
    assert ran.code == 2, (ran.code, ran.out, ran.err)
    assert fragment in ran.error, ran.error


def check_one_line(exc: TrainguardError) -> None:
    message = str(exc)
    assert message and "\n" not in message and "\r" not in message, message


@contextmanager
def scratch() -> Iterator[Path]:
    """A fresh folder for one hypothesis example (pytest's tmp_path is shared by them all)."""
    with tempfile.TemporaryDirectory() as folder:
        yield Path(folder)


def run_dir(root: Path, metrics: str = HEALTHY_METRICS, events: str | None = None) -> Path:
    d = root / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text(metrics)
    if events is not None:
        (d / "events.jsonl").write_text(events)
    return d


def setup_file(root: Path, body: str, head: str = "import torch\n") -> str:
    """A FILE.py:build target whose build() runs `body`."""
    path = root / "tg_fuzz_setup.py"
    path.write_text(head + "def build():\n" + "".join(f"    {line}\n" for line in body.split("\n")))
    return f"{path}:build"


# -- the fixed cases of the issue ------------------------------------------------------------


def _big_field_csv(root: Path) -> list[str | Path]:
    rows = "".join(f"{i},{3 - i / 100},note\n" for i in range(60))
    big = root / "big.csv"
    with big.open("w") as f:  # a 50 MB note, and a bad row that sends the block row by row
        f.write("step,loss,note\n" + rows + "60,2.5," + "x" * BIG_FIELD + "\n61,oops,y\n")
    return ["analyze", big, "--json"]


def _big_header_csv(root: Path) -> list[str | Path]:
    (root / "head.csv").write_text("step,x" + "y" * BIG_FIELD + "\n1,2\n")
    return ["analyze", root / "head.csv"]


def _file(name: str, data: str | bytes, *args: str) -> Callable[[Path], list[str | Path]]:
    def make(root: Path) -> list[str | Path]:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data)
        return [a.replace("{f}", str(path)).replace("{d}", str(root)) for a in args]

    return make


def _fifo(*args: str) -> Callable[[Path], list[str | Path]]:
    def make(root: Path) -> list[str | Path]:
        os.mkfifo(root / "pipe")
        return [a.replace("{f}", str(root / "pipe")) for a in args]

    return make


def _run(events: str, *args: str, metrics: str = HEALTHY_METRICS) -> Callable[[Path], list[str]]:
    def make(root: Path) -> list[str]:
        d = run_dir(root, metrics, events)
        return [a.replace("{d}", str(d)).replace("{root}", str(root)) for a in args]

    return make


def _setup(body: str, command: str = "lint", head: str = "import torch\n") -> Callable:
    def make(root: Path) -> list[str | Path]:
        target = setup_file(root, body, head)
        return [command, target] + (["--run-dir", str(root)] if command == "scan" else [])

    return make


DIGITS_401 = '{"step": 60, "loss": ' + "9" * 401 + "}\n"
DIGITS_5001 = '{"step": 60, "loss": ' + "9" * 5001 + "}\n"
DEEP_JSON = "[" * 100_000 + "]" * 100_000 + "\n"
JUNK_EVENTS = (
    "garbage\n{not json\n"
    + json.dumps(SPIKE)
    + '\n[1,2]\nnull\n"x"\n{"step": "a", "kind": "loss_spike"}\n'
    + '{"kind": "loss_spike", "step": 31, "severity": "critical", "metrics": [1]}\n'
    + '{"kind": "nan_origin", "step": 30, "metrics": {"frames": 5, "spike_step": [1]}}\n'
    + '{"kind": "spike_samples", "step": 30, "metrics": {"samples": [1, {"id": 3}]}}\n'
    + "[" * 5000
    + "]" * 5000
    + '\n{"kind": "lo'
)
OVERFLOWED = "the loss is inf"  # a loss past the float limit is an infinite one: an incident
WRONG_STEPS = '{"step": 1000000000000000000000000000000, "loss": 1}\n{"step": true, "loss": 1}\n'

FIXED: list[tuple[str, Callable[[Path], list[str | Path]], int, str]] = [
    ("csv-50mb-field", _big_field_csv, 0, "line 63"),
    ("csv-50mb-header-field", _big_header_csv, 2, "no 'loss' column (found: step, xyyyyy"),
    ("random-bytes-csv", _file("r.csv", RANDOM_BYTES, "analyze", "{f}"), 2, "not a text log"),
    ("random-bytes-tsv", _file("r.tsv", RANDOM_BYTES, "analyze", "{f}"), 2, "not a text log"),
    ("random-bytes-jsonl", _file("r.jsonl", RANDOM_BYTES, "analyze", "{f}"), 2, "not a text log"),
    (
        "jsonl-401-digits",
        _file("n.jsonl", HEALTHY_METRICS + DIGITS_401, "analyze", "{f}"),
        1,
        OVERFLOWED,
    ),
    (
        "jsonl-5001-digits",
        _file("n.jsonl", HEALTHY_METRICS + DIGITS_5001, "analyze", "{f}"),
        1,
        OVERFLOWED,
    ),
    (
        "jsonl-1e999",
        _file("n.jsonl", '{"step": 1, "loss": 1e999}\n', "analyze", "{f}"),
        1,
        OVERFLOWED,
    ),
    (
        "jsonl-nested-100k",
        _file("n.jsonl", HEALTHY_METRICS + DEEP_JSON, "analyze", "{f}"),
        0,
        "passed over 1 row(s) without a numeric step and loss: line 61",
    ),
    ("json-nested-5k", _file("n.json", "[" * 5000 + "]" * 5000, "analyze", "{f}"), 2, "no 'step'"),
    ("yaml-nested-5k", _file("c.yaml", "[" * 5000 + "]" * 5000, "config", "{f}"), 2, "nested over"),
    ("yaml-nested-100k", _file("c.yaml", "{a: " * 100_000, "config", "{f}"), 2, "nested over"),
    ("yaml-block-nested", _file("c.yaml", "- " * 100_000 + "x", "config", "{f}"), 2, "too deeply"),
    ("toml-nested-5k", _file("c.toml", "a = " + "[" * 5000, "config", "{f}"), 2, "nested over"),
    ("yaml-latin1", _file("c.yaml", "# caf\xe9\n".encode("latin-1"), "config", "{f}"), 2, "UTF-8"),
    ("toml-latin1", _file("c.toml", b"# caf\xe9\n", "analyze", "x", "--config", "{f}"), 2, "UTF-8"),
    ("yaml-5001-digits", _file("c.yaml", "window: " + "9" * 5001, "config", "{f}"), 2, "digits"),
    ("config-list", _file("c.yaml", "- a\n", "config", "{f}"), 2, "not a list"),
    ("config-string", _file("c.yaml", "hello", "config", "{f}"), 2, "not a string"),
    ("config-unknown-key", _file("c.yaml", "nope: 1", "config", "{f}"), 2, "nope: no such setting"),
    ("config-wrong-type", _file("c.toml", "[stall]\nwindow = 'x'", "config", "{f}"), 2, "window"),
    ("config-newline-key", _file("c.yaml", '"a\\nb": 1', "config", "{f}"), 2, "'a\\nb'"),
    ("analyze-config-shape", _file("c.yaml", "[1]", "analyze", "x", "--config", "{f}"), 2, "list"),
    ("report-config-shape", _file("c.yaml", "3", "report", "x", "--config", "{f}"), 2, "number"),
    ("config-directory", _file("d/x", "", "config", "{d}/d"), 2, "is a directory"),
    ("config-fifo", _fifo("config", "{f}"), 2, "not a regular file"),
    ("analyze-fifo", _fifo("analyze", "{f}"), 2, "not a regular file"),
    ("analyze-empty-dir", _file("d/x", "", "analyze", "{d}/d"), 2, "without metrics.jsonl"),
    ("report-empty-dir", _file("d/x", "", "report", "{d}/d"), 2, "without metrics.jsonl"),
    (
        "tensorboard-random",
        _file("tb/events.out.tfevents.1", RANDOM_BYTES, "analyze", "{d}/tb"),
        2,
        "hold no scalars",
    ),
    ("markup-in-path", _file("a[/b].jsonl", HEALTHY_METRICS, "analyze", "{f}"), 0, ""),
    (
        "report-junk-events",
        _run(JUNK_EVENTS, "report", "{d}", "-o", "{root}/r.html"),
        0,
        "that are not events",
    ),
    (
        "report-wrong-steps",
        _run("", "report", "{d}", "-o", "{root}/r.html", metrics=HEALTHY_METRICS + WRONG_STEPS),
        0,
        "without an integer",
    ),
    (
        "report-truncated-metrics",
        _run(
            "", "report", "{d}", "-o", "{root}/r.html", metrics=HEALTHY_METRICS + '{"step": 60, "lo'
        ),
        0,
        "skipped the truncated last line 61 of metrics.jsonl",
    ),
    (
        "watch-junk-events",
        _run(JUNK_EVENTS, "watch", "{d}", "--duration", "0.2", "--refresh", "0.05"),
        0,
        "",
    ),
    (
        "watch-wrong-steps",
        _run(
            JUNK_EVENTS,
            "watch",
            "{d}",
            "--duration",
            "0.2",
            "--refresh",
            "0.05",
            metrics=HEALTHY_METRICS + WRONG_STEPS + '{"step": "a"}\n',
        ),
        0,
        "",
    ),
    ("watch-refresh-nan", _run("", "watch", "{d}", "--refresh", "nan"), 2, "--refresh"),
    ("watch-duration-negative", _run("", "watch", "{d}", "--duration", "-1"), 2, "--duration"),
    ("report-o-proc", _run("", "report", "{d}", "-o", "/proc/x.html"), 2, "cannot write"),
    (
        "report-o-under-a-file",
        _run("", "report", "{d}", "-o", "{d}/metrics.jsonl/r.html"),
        2,
        "cannot write",
    ),
    ("report-o-directory", _run("", "report", "{d}", "-o", "{d}"), 2, "is a directory"),
    ("lint-syntax-error", _setup("return (", head=""), 2, "raised SyntaxError"),
    (
        "lint-failing-import",
        _setup("pass", head="import no_such_module_tg\n"),
        2,
        "raised ModuleNotFoundError: No module named 'no_such_module_tg'",
    ),
    (
        "lint-factory-raises",
        _setup("raise RuntimeError('boom')"),
        2,
        "build raised RuntimeError: boom",
    ),
    ("lint-factory-exits", _setup("raise SystemExit(3)"), 2, "raised SystemExit: 3"),
    ("lint-returns-a-number", _setup("return 42"), 2, "gave int as its model"),
    (
        "lint-returns-a-bad-optimizer",
        _setup("return torch.nn.Linear(2, 2), 'sgd'"),
        2,
        "gave str as its optimizer",
    ),
    (
        "lint-scheduler-raises",
        _setup(
            "m = torch.nn.Linear(2, 2)\no = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            "return m, o, torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (3 - s))"
        ),
        2,
        "linting the set-up of",
    ),
    ("scan-syntax-error", _setup("return (", "scan", head=""), 2, "raised SyntaxError"),
    ("scan-factory-raises", _setup("raise KeyError('k')", "scan"), 2, "raised KeyError: 'k'"),
    (
        "scan-missing-loss-fn",
        _setup("return torch.nn.Linear(2, 2), [1]", "scan"),
        2,
        "gave nothing as its per_sample_loss_fn",
    ),
    (
        "scan-loss-fn-raises",
        _setup(
            "return torch.nn.Linear(2, 2), [torch.zeros(3, 5)], lambda m, b: m(b).sum(1)", "scan"
        ),
        2,
        "scanning with",
    ),
]


@pytest.mark.parametrize(
    ("make", "code", "fragment"), [c[1:] for c in FIXED], ids=[c[0] for c in FIXED]
)
def test_the_fixed_cases_of_the_issue(tmp_path, make, code, fragment):
    ran = cli(*make(tmp_path))
    check_clean(ran)
    assert ran.code == code, (ran.code, ran.err)
    if code == 2:
        assert fragment in ran.error, ran.error
    else:
        assert fragment in ran.err + ran.out, ran.err


def test_a_50mb_field_in_a_note_column_keeps_its_row(tmp_path):
    ran = cli(*_big_field_csv(tmp_path))
    assert ran.code == 0 and json.loads(ran.out)["summary"]["steps"] == 61


def test_events_with_junk_lines_are_reported_without_them(tmp_path):
    ran = cli("report", run_dir(tmp_path, events=JUNK_EVENTS), "-o", tmp_path / "r.html")
    assert ran.code == 0, ran.err
    assert "skipped the truncated last line 12 of events.jsonl" in ran.err
    assert "passed over 6 unreadable line(s) of events.jsonl" in ran.err
    assert "passed over 2 line(s) of events.jsonl that are not events" in ran.err
    assert "1 warning+ events" in ran.err
    assert 'data-step="30"' in (tmp_path / "r.html").read_text()


def test_watch_shows_the_good_lines_among_junk(tmp_path):
    metrics = HEALTHY_METRICS + WRONG_STEPS + '{"step": "a"}\n{"step": 60, "lo'
    ran = cli(
        "watch", run_dir(tmp_path, metrics, JUNK_EVENTS), "--duration", "0.2", "--refresh", "0.05"
    )
    assert ran.code == 0, ran.err
    assert "step 59" in ran.out and "loss_spike" in ran.out


@pytest.mark.parametrize("reader", ["read_log", "load_run"])
def test_every_reader_skips_a_truncated_last_line(tmp_path, reader):
    d = run_dir(tmp_path, HEALTHY_METRICS + '{"step": 60, "loss": 2.')
    if reader == "read_log":
        data = read_log(d)
        assert data.warnings == ["skipped the truncated last line 61, as a run cut short leaves it"]
    else:
        assert load_run(d).warnings == ["skipped the truncated last line 61 of metrics.jsonl"]
    csv_log = tmp_path / "cut.csv"
    csv_log.write_text(HEALTHY_CSV + "60,")
    assert read_log(csv_log).warnings == [
        "skipped the truncated last line 62, as a run cut short leaves it"
    ]


def test_unreadable_and_unwritable_paths(tmp_path):
    """As root (CI), the console script runs without the capabilities that read and write past
    file permissions, as an ordinary user would."""
    as_user = (
        ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    )
    log = tmp_path / "locked.csv"
    log.write_text(HEALTHY_CSV)
    log.chmod(0)
    expect_error(shell("analyze", log, prefix=as_user), "is not readable")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    expect_error(
        shell("report", run_dir(tmp_path), "-o", locked / "r.html", prefix=as_user), "cannot write"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["analyze", "--bogus"], "error: No such option: --bogus; see 'trainguard analyze --help'"),
        (["analyze"], "error: Missing argument 'path'; see 'trainguard analyze --help'"),
        (["bogus"], "error: No such command 'bogus'; see 'trainguard --help'"),
        (
            ["watch", "x", "--refresh", "abc"],
            "error: Invalid value for '--refresh': Input should be a valid number, unable to "
            "parse string as a number; see 'trainguard watch --help'",
        ),
    ],
)
def test_a_usage_error_is_one_line_that_points_at_the_help(args, message):
    ran = cli(*args)
    check_clean(ran)
    assert ran.code == 2 and ran.error == message
    assert "╭" not in ran.err


def test_any_other_exception_is_one_line_asking_for_a_report(tmp_path, monkeypatch):
    import trainguard.analysis

    def broken(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("planted")

    monkeypatch.setattr(trainguard.analysis, "analyze", broken)
    log = tmp_path / "ok.csv"
    log.write_text(HEALTHY_CSV)
    ran = cli("analyze", log)
    assert ran.code == 2 and "Traceback" not in ran.err
    assert ran.error == (
        "error: internal error (ZeroDivisionError: planted); please report it with the command "
        "you ran"
    )

    def denied(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", "/somewhere")

    monkeypatch.setattr(trainguard.analysis, "analyze", denied)
    ran = cli("analyze", log)
    assert ran.code == 2
    assert ran.error == "error: /somewhere: Permission denied; check the path and its permissions"


def test_a_loss_near_the_float_limit():
    from trainguard.analysis import analyze

    loss = 2.0 + np.random.default_rng(0).standard_normal(30)
    loss[-1] = -1e308
    result = analyze(LogData(np.arange(30), loss))  # |z| / bin width overflowed int() once
    assert result.summary["steps"] == 30


# -- the strategies ---------------------------------------------------------------------------

NAMES = ("step", "loss", "grad_norm", "lr", "loss_scale", "iteration", "")
LONG_NUMBERS = ("9" * 401, "-" + "9" * 401, "9" * 5001, "1e999", "-1e999")
number_texts = st.one_of(
    st.integers(-(10**300), 10**300).map(str),
    st.floats().map(repr),
    st.sampled_from(("nan", "inf", "-inf", "-0", " 1 ", "", "1_000", "0x10", *LONG_NUMBERS)),
)
"""Numbers as a log writes them, up to the float limit (see test_a_loss_near_the_float_limit),
and ones past what a float or an int conversion takes."""
extreme_number_texts = number_texts | st.floats().map(repr) | st.integers().map(str)
cells = st.one_of(number_texts, st.text(max_size=12), st.just("x" * 200_000))


@st.composite
def delimited_logs(draw: st.DrawFn, numbers: st.SearchStrategy[str] = number_texts) -> tuple:
    """(suffix, text) of a CSV or TSV log: a header (usually with step and loss), rows of
    numbers and junk, and maybe no newline at the end or a cut last line."""
    sep = draw(st.sampled_from([",", "\t", ";"]))
    extra = draw(st.lists(st.sampled_from(NAMES) | st.text(max_size=8), max_size=3))
    header = (["step", "loss"] if draw(st.booleans()) else []) + extra
    cell = numbers | cells
    rows = draw(st.lists(st.lists(cell, min_size=0, max_size=len(header) + 1), max_size=25))
    text = "\n".join(sep.join(r) for r in [header, *rows])
    text += draw(st.sampled_from(["\n", "", "\r\n"]))
    if draw(st.booleans()):
        text = text[: draw(st.integers(0, len(text)))]
    return draw(st.sampled_from([".csv", ".tsv", ".txt", ".log"])), text


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**300), 10**300)
    | st.floats()
    | st.sampled_from([float("nan"), float("inf")])
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)
metric_records = st.fixed_dictionaries(
    {"step": st.integers(-3, 500) | st.sampled_from([10**30, True, "a", None, 2.5])},
    optional={
        "loss": json_values | st.floats(0.5, 10),
        "grad_norm": json_values,
        "lr": json_values,
        "loss_scale": json_values,
        "group_grad_norms": st.dictionaries(st.text(max_size=4), json_values, max_size=3),
        "action": json_values,
    },
)
event_records = st.fixed_dictionaries(
    {"kind": st.sampled_from(EVENT_KINDS) | json_values, "step": st.integers(0, 500) | json_values},
    optional={
        "severity": st.sampled_from(["info", "warning", "critical"]) | json_values,
        "type": json_values,
        "message": json_values,
        "action": json_values,
        "metrics": st.dictionaries(
            st.sampled_from(["loss", "frames", "samples", "spike_step", "first_group"]),
            json_values,
        )
        | json_values,
    },
)
junk_lines = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["[1,2]", "null", '"x"', '{"step": "a"}', "{", "}", "[]"]),
    st.integers(1, 3000).map(lambda depth: "[" * depth + "]" * depth),
    st.sampled_from(LONG_NUMBERS).map(lambda n: '{"step": 1, "loss": ' + n + "}"),
)


def jsonl(records: st.SearchStrategy[dict]) -> st.SearchStrategy[str]:
    """JSONL text: mostly records, some junk lines, and maybe a last line cut short."""
    lines = st.lists(records.map(json.dumps) | junk_lines, max_size=40)

    @st.composite
    def text(draw: st.DrawFn) -> str:
        body = "".join(line.replace("\n", " ") + "\n" for line in draw(lines))
        cut = draw(st.integers(0, 30)) if draw(st.booleans()) else 0
        return body[: len(body) - cut]

    return text()


config_keys = st.sampled_from(
    [
        "loss_spike",
        "window",
        "z_threshold",
        "policy",
        "skip_on",
        "max_grad_norm",
        "alerts",
        "rules",
        "kinds",
        "group_patterns",
        "stall",
        "recovery",
    ]
) | st.text(max_size=8)
config_trees = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(config_keys, inner, max_size=4),
    max_leaves=12,
)
toml_values = st.sampled_from(
    ["1", "-1", "1.5", "nan", "inf", "true", "'x'", '"(["', "[1, 2]", "{a = 1}", "[[", "9" * 5001]
)


@st.composite
def toml_texts(draw: st.DrawFn) -> str:
    lines = []
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.booleans()):
            lines.append(f"[{draw(config_keys)}]")
        else:
            lines.append(f"{draw(config_keys)} = {draw(toml_values)}")
    return "\n".join(lines)


config_files = st.one_of(
    st.tuples(st.just(".yaml"), config_trees.map(lambda t: yaml.safe_dump(t))),
    st.tuples(st.just(".yaml"), st.text(max_size=80)),
    st.tuples(st.just(".toml"), toml_texts()),
    st.tuples(st.sampled_from([".yaml", ".toml", ".yml"]), st.binary(max_size=80)),
)
factory_bodies = st.one_of(
    st.sampled_from(
        [
            "return 42",
            "return None",
            "return {}",
            "return []",
            "return {'model': 1}",
            "return (torch.nn.Linear(2, 2),)",
            "return torch.nn.Linear(2, 2), 'opt'",
            "return torch.nn.Linear(2, 2), None, 5",
            "m = torch.nn.Linear(2, 2)\nreturn m, torch.optim.Adam(m.parameters())",
            "return torch.nn.Linear(2, 2), [torch.zeros(3, 2)], lambda m, b: m(b).sum(1)",
            "return torch.nn.Linear(2, 2), [torch.zeros(3, 2)], lambda m, b: m(b).sum()",
            "return torch.nn.Linear(2, 2), [1, 2], lambda m, b: b.x",
            "return torch.nn.Linear(2, 2), 5, len",
            "return {'model': torch.nn.Linear(2, 2), 'batches': [], 'per_sample_loss_fn': len}",
            "raise SystemExit(3)",
            "raise SystemExit('bye')",
            "return build()",
        ]
    ),
    st.tuples(
        st.sampled_from(["RuntimeError", "ValueError", "OSError", "KeyError", "MemoryError"]),
        st.text(max_size=20),
    ).map(lambda t: f"raise {t[0]}({t[1]!r})"),
    # module-level garbage without letters or '*' and '<': a syntax or value error, never a loop
    st.text(alphabet="()[]{}:=+-/.,'\"#\\ \n\t0123456789", max_size=30).map(lambda s: "\n" + s),
)


def write(root: Path, name: str, data: str | bytes) -> Path:
    path = root / name
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data, encoding="utf-8", errors="surrogatepass")
    return path


def write_run(root: Path, metrics: str, events: str, config: str | None) -> Path:
    d = root / "run"
    d.mkdir()
    write(d, "metrics.jsonl", metrics)
    write(d, "events.jsonl", events)
    if config is not None:
        write(d, "config.json", config)
    return d


def setup_target(root: Path, body: str) -> str:
    if body.startswith("\n"):  # garbage at module level, before build()
        path = root / "tg_fuzz_setup.py"
        path.write_text(body + "\ndef build():\n    return 1\n")
        return f"{path}:build"
    return setup_file(root, body)


# -- the readers, in this process -------------------------------------------------------------


@settings(FUZZ, max_examples=150)
@given(
    log=delimited_logs(extreme_number_texts) | st.tuples(st.just(".jsonl"), jsonl(metric_records))
)
def test_read_log_of_any_text(log):
    suffix, text = log
    with scratch() as root:
        path = write(root, "log" + suffix, text)
        try:
            data = read_log(path)
        except TrainguardError as exc:
            check_one_line(exc)
            return
        assert len(data.steps) == len(data.loss) > 0 and not np.isnan(data.steps).any()
        assert np.all(np.diff(data.steps) > 0)


@settings(FUZZ, max_examples=40)
@given(
    data=st.binary(max_size=3000),
    name=st.sampled_from(["x.csv", "x.tsv", "x.jsonl", "x.bin", "events.out.tfevents.1"]),
)
def test_read_log_of_any_bytes(data, name):
    with scratch() as root:
        try:
            read_log(write(root, name, data))
        except TrainguardError as exc:
            check_one_line(exc)


@settings(FUZZ, max_examples=80)
@given(config=config_files)
def test_config_load_of_any_file(config):
    suffix, text = config
    with scratch() as root:
        try:
            GuardConfig.load(write(root, "c" + suffix, text))
        except TrainguardError as exc:
            check_one_line(exc)


@settings(FUZZ, max_examples=40)
@given(
    metrics=jsonl(metric_records),
    events=jsonl(event_records),
    config=st.none() | json_values.map(json.dumps) | st.text(max_size=20),
)
def test_run_folders_load_report_and_watch(metrics, events, config):
    with scratch() as root:
        d = write_run(root, metrics, events, config)
        watcher = RunWatcher(d)
        watcher.poll()
        Console(file=io.StringIO(), width=100).print(watcher.render())
        try:
            record = load_run(d)
        except TrainguardError as exc:
            check_one_line(exc)
            return
        write_report(record, root / "r.html")


# -- every subcommand, in this process and through the console script -------------------------


SUBCOMMANDS = ("analyze", "report", "watch", "config", "lint", "scan")


@st.composite
def commands(draw: st.DrawFn, root: Path, command: str | None = None) -> list[str | Path]:
    """A subcommand (`command`, or any) with generated input under `root`."""
    command = command or draw(st.sampled_from(SUBCOMMANDS))
    if command == "config":
        suffix, text = draw(config_files)
        return ["config", write(root, "c" + suffix, text)]
    if command in ("lint", "scan"):
        target = setup_target(root, draw(factory_bodies))
        return [command, target] + (["--run-dir", root] if command == "scan" else [])
    if command == "watch" or draw(st.booleans()):
        metrics, events = draw(jsonl(metric_records)), draw(jsonl(event_records))
        source: Path = write_run(root, metrics, events, draw(st.none() | st.text(max_size=20)))
    else:
        suffix, text = draw(delimited_logs() | st.tuples(st.just(".jsonl"), jsonl(metric_records)))
        source = write(root, "log" + suffix, text)
    if command == "watch":
        return ["watch", source, "--duration", "0.1", "--refresh", "0.05"]
    if command == "report":
        return ["report", source, "-o", root / "r.html"]
    return ["analyze", source] + (["--json"] if draw(st.booleans()) else [])


@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_every_subcommand_in_process(data):
    with scratch() as root:
        check_clean(cli(*data.draw(commands(root))))


SHELL_RUNS = {"analyze": 2, "report": 2, "watch": 2, "config": 2, "lint": 1, "scan": 1}
"""Console-script runs per subcommand; lint and scan import torch, some 5 s a run."""


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_through_the_console_script(command):
    @settings(FUZZ, max_examples=SHELL_RUNS[command])
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        with scratch() as root:
            check_clean(shell(*data.draw(commands(root, command))))

    run()
