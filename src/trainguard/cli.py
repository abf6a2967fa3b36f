"""The `trainguard` command line."""

from __future__ import annotations

import os
import sys
from enum import Enum
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
import yaml
from rich.console import Console
from rich.markup import escape

from trainguard import __version__
from trainguard.analysis.formats import names as format_names
from trainguard.analysis.watch import QUIET_STEPS
from trainguard.config import GuardConfig
from trainguard.events import TrainguardError

if TYPE_CHECKING:
    from trainguard.analysis import Analysis, LogData

app = typer.Typer(
    name="trainguard",
    help="Keeps neural-network training stable: watch, detect, act.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
DEFAULT_MAX_GRAD_NORM = float(GuardConfig.model_fields["max_grad_norm"].default)  # the guard's
PLAIN_WIDTH = 160  # columns of tables written to a pipe or a file (rich assumes 80)


def out_console() -> Console:
    """A console for stdout: the terminal's width, or PLAIN_WIDTH columns where the output is
    a pipe or a file and COLUMNS does not say otherwise."""
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=PLAIN_WIDTH)
    return console


MAX_MESSAGE = 2000  # characters of an error line; a longer one is cut
MAX_REFRESH_S = 86_400.0
PLAIN_EVERY_S = 5.0  # watch to a pipe or file: a status line at most this often
LINT_KEYS = ("model", "optimizer", "scheduler", "scaler")
SCAN_KEYS = ("model", "batches", "per_sample_loss_fn")
FORMAT_NAMES = ", ".join(format_names())
# the options of every command that reads a log
LossColumn = Annotated[str, typer.Option("--column", help="The loss column of a CSV/JSONL log.")]
StepColumn = Annotated[str, typer.Option(help="The step column of a CSV/JSONL log.")]
TensorBoardTag = Annotated[str | None, typer.Option(help="The TensorBoard scalar of the loss.")]
LogFormatName = Annotated[
    str | None,
    typer.Option(
        "--format", help=f"The log's format (default: found from its content): {FORMAT_NAMES}."
    ),
]
RunName = Annotated[
    str | None, typer.Option(help="In a file of several runs (a W&B export), this one.")
]


class AutocastDtype(str, Enum):
    """The dtype the run's forward computes in under autocast, as `lint --autocast` names it."""

    fp16 = "fp16"
    bf16 = "bf16"


AUTOCAST_TORCH_NAMES = {AutocastDtype.fp16: "float16", AutocastDtype.bf16: "bfloat16"}


@app.command()
def demo(
    steps: Annotated[int, typer.Option(help="Training steps.")] = 400,
    run_dir: Annotated[Path, typer.Option(help="Where events and metrics go.")] = Path("runs/demo"),
    seed: Annotated[int, typer.Option(help="Seed of the model, data and faults.")] = 0,
) -> None:
    """Train a tiny GPT on the CPU through planted incidents and show what the guard does."""
    from trainguard.demo.run import run_demo

    run_demo(steps=steps, run_dir=run_dir, seed=seed, console=out_console())


@app.command()
def config(
    path: Annotated[Path | None, typer.Argument(help="A YAML or TOML config to check.")] = None,
    reference: Annotated[
        bool,
        typer.Option(
            "--reference",
            help="Print the reference of every setting (type, default, description) as Markdown.",
        ),
    ] = False,
) -> None:
    """Print the effective configuration (the defaults, or PATH merged over them) as YAML; with
    --reference, every setting's type, default and description as Markdown."""
    if reference:
        if path is not None:
            _fail("--reference describes the defaults and takes no config file; drop PATH")
        from trainguard.config_reference import config_reference

        typer.echo(config_reference(), nl=False)
        return
    cfg = GuardConfig.load(path) if path is not None else GuardConfig()
    typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip())


@app.command()
def analyze(
    path: Annotated[
        Path,
        typer.Argument(
            help="A training log (its format is found from its content; see --format), or a "
            "run directory."
        ),
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    config: Annotated[Path | None, typer.Option(help="A YAML or TOML GuardConfig.")] = None,
    column: LossColumn = "loss",
    step_column: StepColumn = "step",
    tag: TensorBoardTag = None,
    log_format: LogFormatName = None,
    run: RunName = None,
) -> None:
    """Judge an existing training log with the guard's detectors: exit 0 when healthy, 1 when
    incidents at warning or above were found (a NaN/Inf loss is one, a log NaN from the start a
    failed run), 2 on bad input (no row with a numeric step and loss). A file of several runs
    is judged run by run. A run directory or its metrics.jsonl also shows the events the
    guarded run recorded in events.jsonl, and the steps a rollback abandoned."""
    import json

    from trainguard.analysis import analyze as run_analysis
    from trainguard.analysis.logs import read_runs

    cfg = GuardConfig.load(config) if config is not None else GuardConfig(console=False)
    runs = read_runs(path, column, step_column, tag, log_format, run)
    results = [run_analysis(data, cfg) for data in runs]
    if as_json:
        objects = []
        for data, result in zip(runs, results, strict=True):
            judged = result.to_dict()
            judged["summary"]["format"] = data.format
            objects.append({"run": data.run, **judged} if data.run else judged)
        out = objects[0] if len(objects) == 1 else {"runs": objects}
        typer.echo(json.dumps(out, allow_nan=False))
    else:
        for data, result in zip(runs, results, strict=True):
            _show_analysis(path, data, result)
    if any(result.incidents for result in results):
        raise typer.Exit(1)


def _show_analysis(path: Path, data: LogData, result: Analysis) -> None:
    """One run's judgement as a table and a summary line, its read's warnings on stderr."""
    from rich.table import Table

    for warning in data.warnings:
        err.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False)
    which = f" (run {data.run})" if data.run else ""
    table = Table(
        title=escape(f"trainguard analyze {path}{which} [{data.format}]"), title_justify="left"
    )
    for column in ("step", "kind", "type", "severity", "magnitude", "source", "what"):
        table.add_column(column, overflow="fold")
    for e in result.events:
        if e.severity == "info" and e.kind != "spike_classified":
            continue
        magnitude = e.metrics.get("ratio") or e.metrics.get("rise") or ""
        table.add_row(
            str(e.step),
            e.kind,
            e.type or "",
            e.severity,
            f"{magnitude:.3g}" if isinstance(magnitude, float) else str(magnitude),
            result.source(e),
            escape(e.message),
        )
    console = out_console()
    console.print(table)
    s = result.summary
    verdict = (
        f"{len(result.incidents)} incident(s) at warning or above"
        if result.incidents
        else "healthy: no incident at warning or above"
    )
    final = "none finite" if s["final_loss"] is None else f"{s['final_loss']:.4g}"
    if s.get("ends_nonfinite") and s["final_loss"] is not None:
        final = f"NaN/Inf (the last finite one {s['final_loss']:.4g})"
    dense = s["last_step"] - s["first_step"] + 1 == s["steps"]
    rows = f"{s['steps']} steps" if dense else f"{s['steps']} logged points over steps"
    extra = [
        f"{s[key]} {what}"
        for key, what in (
            ("nonfinite_steps", "with a NaN/Inf loss"),
            ("abandoned_steps", "abandoned (undone by a rollback, or replaced on a restart)"),
            ("recorded_events", "events recorded by the run"),
        )
        if s[key]
    ]
    console.print(
        f"{rows} ({s['first_step']}..{s['last_step']}"
        + "".join(f", {x}" for x in extra)
        + f"), final loss {final}, loss spike score {s['spike_score']['loss']:.2e}: {verdict}"
    )


@app.command()
def report(
    source: Annotated[
        Path,
        typer.Argument(
            help="A run directory (metrics.jsonl, events.jsonl) or a training log in any format "
            "analyze reads."
        ),
    ],
    output: Annotated[Path, typer.Option("-o", "--output", help="The HTML file to write.")] = Path(
        "report.html"
    ),
    config: Annotated[
        Path | None, typer.Option(help="A GuardConfig to judge a bare log with.")
    ] = None,
    title: Annotated[str | None, typer.Option(help="The page title.")] = None,
    log_format: LogFormatName = None,
    run: RunName = None,
    column: LossColumn = "loss",
    step_column: StepColumn = "step",
    tag: TensorBoardTag = None,
) -> None:
    """Write one self-contained HTML report (plots, incident cards, lint, config) of a run or
    log; it opens offline in any browser."""
    from trainguard.analysis.run import load_run
    from trainguard.run_files import RunFileError
    from trainguard.sinks.html_report import require_plotly, write_report

    require_plotly()  # before the log is read
    cfg = GuardConfig.load(config) if config is not None else None
    record = load_run(source, cfg, log_format, run, column, step_column, tag)
    if title is None and run is not None:
        title = f"trainguard report: {source} (run {run})"
    for warning in record.warnings:
        err.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False)
    if output.is_dir():
        raise TrainguardError(f"{output} is a directory: give the HTML file to write with -o")
    if not output.parent.exists():
        raise TrainguardError(f"{output.parent} does not exist: create it or choose another -o")
    try:
        path = write_report(record, output, title)
    except RunFileError:
        raise  # a link or FIFO at -o: its own one-line error
    except OSError as exc:
        raise TrainguardError(
            f"cannot write {output}: {exc.strerror or exc}; choose another -o"
        ) from None
    incidents = sum(1 for e in record.events if e.get("severity") in ("warning", "critical"))
    err.print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MB, {incidents} warning+ events)")


@app.command()
def watch(
    run_dir: Annotated[
        Path,
        typer.Argument(help="The run directory of a running job (waited for until it exists)."),
    ],
    refresh: Annotated[float, typer.Option(help="Seconds between reads of its files.")] = 1.0,
    duration: Annotated[
        float | None, typer.Option(help="Stop after this many seconds (default: until Ctrl-C).")
    ] = None,
    quiet_steps: Annotated[
        int,
        typer.Option(
            min=1, help="Steps without a new warning or critical event after which health is back."
        ),
    ] = QUIET_STEPS,
) -> None:
    """A live terminal dashboard of a running job: step, loss and grad-norm sparklines, health,
    the latest incidents. Waits for RUN_DIR to appear; stops by itself when the run halts or
    closes."""
    import math
    import time

    from rich.live import Live

    from trainguard.analysis.watch import RunWatcher

    if not 0 < refresh <= MAX_REFRESH_S:
        raise TrainguardError(
            f"--refresh must be a number of seconds above 0 and at most {MAX_REFRESH_S:g}, "
            f"got {refresh}"
        )
    if duration is not None and not duration >= 0:
        raise TrainguardError(f"--duration must be a number of seconds >= 0, got {duration}")
    if duration is not None and math.isinf(duration):
        duration = None  # forever, as without it
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainguardError(f"{run_dir} is not a directory: give the run_dir of a Guard")
    watcher = RunWatcher(run_dir, quiet_steps=quiet_steps)
    start = time.monotonic()
    console = Console()
    if not console.is_terminal:  # piped or to a file: plain lines, not a redrawn panel
        shown, shown_at = "", -math.inf
        while True:
            watcher.poll()
            for incident in watcher.incident_lines():
                print(incident, flush=True)
            now = time.monotonic()
            stop = duration is not None and now - start >= duration
            done = watcher.halted or watcher.finished or stop
            line = watcher.line()
            if line != shown and (now - shown_at >= PLAIN_EVERY_S or done):
                print(line, flush=True)
                shown, shown_at = line, now
            if done:
                return
            time.sleep(refresh)
    with Live(watcher.render(), console=console, refresh_per_second=4) as live:
        while True:
            watcher.poll()
            live.update(watcher.render())
            stop = duration is not None and time.monotonic() - start >= duration
            if watcher.halted or watcher.finished or stop:
                break
            time.sleep(refresh)


@app.command("lint")
def lint_command(
    target: Annotated[
        str,
        typer.Argument(
            help="MODULE:FUNCTION or FILE.py:FUNCTION returning (model, optimizer[, scheduler"
            "[, scaler]]) or a dict with those keys."
        ),
    ],
    total_steps: Annotated[int | None, typer.Option(help="Planned optimizer steps.")] = None,
    max_grad_norm: Annotated[
        float,
        typer.Option(
            help="The clip threshold the run uses: the guard's (GuardConfig.max_grad_norm) by "
            "default; 0 for a run that does not clip."
        ),
    ] = DEFAULT_MAX_GRAD_NORM,
    autocast: Annotated[
        AutocastDtype | None,
        typer.Option(help="The dtype the forward runs in under autocast; omit for none."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the findings as JSON.")] = False,
) -> None:
    """Lint a training set-up: exit 1 when a warning or worse is found, 0 when clean."""
    import json

    import torch
    from rich.table import Table

    from trainguard.diagnosis.lint import lint
    from trainguard.events import SEVERITY_RANK

    setup = _load_setup(target)
    try:
        findings = lint(
            setup["model"],
            setup.get("optimizer"),
            setup.get("scheduler"),
            setup.get("scaler"),
            max_grad_norm if max_grad_norm > 0 else None,
            total_steps,
            getattr(torch, AUTOCAST_TORCH_NAMES[autocast]) if autocast is not None else None,
        )
    except TrainguardError:
        raise
    except Exception as exc:  # the model, optimizer or scheduler of the set-up failed
        raise _user_code_error(f"linting the set-up of {target}", exc) from None
    if as_json:
        typer.echo(json.dumps([f.to_dict() for f in findings], indent=1))
    elif not findings:
        out_console().print("[green]no findings[/]")
    else:
        table = Table(title=escape(f"trainguard lint {target}"), title_justify="left")
        for column in ("severity", "code", "what", "fix"):
            table.add_column(column, overflow="fold")
        for f in findings:
            table.add_row(f.severity, f.code, escape(f.message), escape(f.fix))
        out_console().print(table)
    if any(SEVERITY_RANK[f.severity] >= SEVERITY_RANK["warning"] for f in findings):
        raise typer.Exit(1)


@app.command("scan")
def scan_command(
    target: Annotated[
        str,
        typer.Argument(
            help="MODULE:FUNCTION or FILE.py:FUNCTION returning (model, batches, "
            "per_sample_loss_fn) or a dict with those keys (and optionally 'ids', 'text')."
        ),
    ],
    run_dir: Annotated[
        Path, typer.Option(help="The run directory whose quarantine.jsonl gets the samples.")
    ],
    z: Annotated[float, typer.Option(help="Robust z over the dataset that flags a sample.")] = 5.0,
    perplexity: Annotated[
        float | None, typer.Option(help="Also flag samples with a perplexity over this.")
    ] = None,
    min_excess: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="A flagged sample's loss is at least this far above the median, in the loss's "
            "units (1 nat of cross-entropy); set it for losses on another scale.",
        ),
    ] = 1.0,
) -> None:
    """Scan a dataset offline for toxic samples and quarantine them for the guard."""
    from trainguard.diagnosis.scan import scan

    setup = _load_setup(target, SCAN_KEYS)
    extra = {k: setup[k] for k in ("ids", "text") if k in setup}
    try:
        result = scan(
            setup["model"],
            setup["batches"],
            setup["per_sample_loss_fn"],
            z_threshold=z,
            perplexity=perplexity,
            min_excess=min_excess,
            quarantine_path=run_dir / "quarantine.jsonl",
            **extra,
        )
    except (TrainguardError, OSError):
        raise
    except Exception as exc:  # the model, batches or loss function of the set-up failed
        raise _user_code_error(f"scanning with {target}", exc) from None
    console = out_console()
    console.print(
        f"scanned {result.scanned} samples (median loss {result.median_loss:.4g}); "
        f"{len(result.flagged)} flagged"
        + (f" and quarantined in {result.quarantine}" if result.flagged else ""),
        markup=False,
    )
    for s in result.flagged[:20]:
        preview = f"  {s.preview!r}" if s.preview else ""
        console.print(
            f"  {s.id}: loss {s.loss:.4g} (z={s.z:.1f}){preview}", highlight=False, markup=False
        )


def _load_setup(target: str, keys: tuple[str, ...] = LINT_KEYS) -> dict[str, Any]:
    """What the factory named by `target` builds, by `keys`; the user's code failing to import,
    raising or returning the wrong things is a TrainguardError that says which."""
    where, _, name = target.rpartition(":")
    if not where or not name:
        raise TrainguardError(f"give MODULE:FUNCTION or FILE.py:FUNCTION, got {target!r}")
    module = _import_module(where)
    try:
        factory = getattr(module, name, None)
        built = factory() if callable(factory) else None
    except (Exception, SystemExit) as exc:  # the user's code: its failure is bad input
        raise _user_code_error(target, exc) from None
    if not callable(factory):
        raise TrainguardError(
            f"{where} has no function {name}: give {where}:FUNCTION, the function in it that "
            "builds the set-up"
        )
    if isinstance(built, dict):
        setup = dict(built)
    elif isinstance(built, (tuple, list)):
        setup = dict(zip(keys, built, strict=False))
    else:
        setup = {"model": built}
    _check_setup(target, setup, keys)
    return setup


def _import_module(where: str) -> ModuleType:
    """The module of a target: a FILE.py run as a module, or a MODULE imported as `python -m`
    would (from the current folder first, then the installed packages)."""
    import importlib
    import importlib.util
    import sys

    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise TrainguardError(f"{path} not found: give the file that builds the set-up")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise TrainguardError(f"{path} cannot be imported: give a Python source file")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.parent.resolve()))
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:  # a syntax error, a failing import, ...
            raise _user_code_error(f"importing {path}", exc) from None
        return module
    here = str(Path.cwd())
    if here not in sys.path:
        sys.path.insert(0, here)  # as `python -m` does: a module in the current folder
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if where == missing or where.startswith(missing + "."):  # the target, not its imports
            raise TrainguardError(
                f"no module {where} in {here} or the installed packages: run trainguard from the "
                "folder that holds it, or give FILE.py:FUNCTION"
            ) from None
        raise _user_code_error(f"importing {where}", exc) from None
    except (Exception, SystemExit) as exc:
        raise _user_code_error(f"importing {where}", exc) from None


def _check_setup(target: str, setup: dict[str, Any], keys: tuple[str, ...]) -> None:
    """The set-up has what lint or scan needs, of the right types, or a TrainguardError says
    what is wrong with it."""
    from collections.abc import Iterable

    import torch

    def wrong(key: str, needed: str) -> TrainguardError:
        got = type(setup[key]).__name__ if key in setup else "nothing"
        return TrainguardError(f"{target} gave {got} as its {key}: it must be {needed}")

    if not isinstance(setup.get("model"), torch.nn.Module):
        raise wrong("model", "a torch.nn.Module (returned first, or under 'model')")
    if keys == SCAN_KEYS:
        if not isinstance(setup.get("batches"), Iterable):
            raise wrong("batches", "an iterable of batches")
        if not callable(setup.get("per_sample_loss_fn")):
            raise wrong("per_sample_loss_fn", "a function of (model, batch)")
        if "ids" in setup and not callable(setup["ids"]):
            raise wrong("ids", "a function of a batch")
        if setup.get("text") is not None and not callable(setup["text"]):
            raise wrong("text", "a function of a batch or None")
        return
    optimizer, scheduler, scaler = (setup.get(k) for k in ("optimizer", "scheduler", "scaler"))
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise wrong("optimizer", "a torch.optim.Optimizer or None")
    methods = ("step", "state_dict", "load_state_dict")
    if scheduler is not None and not all(callable(getattr(scheduler, m, None)) for m in methods):
        raise wrong("scheduler", "an LR scheduler of torch.optim.lr_scheduler or None")
    if scaler is not None and not callable(getattr(scaler, "is_enabled", None)):
        raise wrong("scaler", "a torch.amp.GradScaler or None")


def _user_code_error(what: str, exc: BaseException) -> TrainguardError:
    """The user's code failed: one line naming what ran and what it raised."""
    detail = str(exc)
    return TrainguardError(
        f"{what} raised {type(exc).__name__}" + (f": {detail}" if detail else "")
    )


@app.command()
def version() -> None:
    """Print the version."""
    typer.echo(__version__)


def _program_name() -> str:
    """How the user started trainguard: `python -m trainguard`, or the script's own name (click
    would otherwise name another `python -m` host, such as pytest's, in its messages)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name in ("trainguard", "trainguard.__main__"):
        return "python -m trainguard"
    return os.path.basename(sys.argv[0]) or "trainguard"


def main() -> None:
    """Entry point: run the app, turning every error into one line and exit code 2, never a
    traceback: trainguard's errors as they say, a path that failed with the OS's reason, and
    anything else as an internal error to report."""
    try:
        code = app(standalone_mode=False, prog_name=_program_name())
    except typer.TyperException as exc:  # a wrong command, option or argument, in one line
        if type(exc).__name__ == "NoArgsIsHelpError":  # `trainguard` alone: the help
            exc.show()  # type: ignore[attr-defined]
            raise SystemExit(2) from None
        context = getattr(exc, "ctx", None)
        command = context.command_path if context is not None else "trainguard"
        _fail(f"{exc.format_message().rstrip('.')}; see '{command} --help'")
    except typer.Exit as exc:
        raise SystemExit(exc.exit_code) from None
    except typer.Abort:
        err.print("interrupted")
        raise SystemExit(130) from None
    except TrainguardError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        err.print("interrupted")
        raise SystemExit(130) from None
    except OSError as exc:  # a path the command could not read or write
        where = f"{exc.filename}: " if exc.filename else ""
        _fail(f"{where}{exc.strerror or exc}; check the path and its permissions")
    except Exception as exc:  # the last resort: a bug, said in one line
        _fail(
            f"internal error ({type(exc).__name__}: {exc}); please report it with the command "
            "you ran"
        )
    if isinstance(code, int) and code:
        raise SystemExit(code)


def _fail(message: str) -> NoReturn:
    """Print `message` as one line (whitespace folded, cut at `MAX_MESSAGE` characters) after
    "error:" and exit 2."""
    line = " ".join(message.split())
    if len(line) > MAX_MESSAGE:
        line = line[: MAX_MESSAGE - 3] + "..."
    err.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    raise SystemExit(2) from None
