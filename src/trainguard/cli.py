"""The `trainguard` command line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.markup import escape

from trainguard import __version__
from trainguard.config import GuardConfig
from trainguard.events import TrainguardError

app = typer.Typer(
    name="trainguard",
    help="Keeps neural-network training stable: watch, detect, act.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)


@app.command()
def demo(
    steps: Annotated[int, typer.Option(help="Training steps.")] = 400,
    run_dir: Annotated[Path, typer.Option(help="Where events and metrics go.")] = Path("runs/demo"),
    seed: Annotated[int, typer.Option(help="Seed of the model, data and faults.")] = 0,
) -> None:
    """Train a tiny GPT on the CPU through planted incidents and show what the guard does."""
    from trainguard.demo.run import run_demo

    run_demo(steps=steps, run_dir=run_dir, seed=seed)


@app.command()
def config(
    path: Annotated[Path | None, typer.Argument(help="A YAML or TOML config to check.")] = None,
) -> None:
    """Print the effective configuration (the defaults, or PATH merged over them) as YAML."""
    cfg = GuardConfig.load(path) if path is not None else GuardConfig()
    typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip())


@app.command()
def analyze(
    path: Annotated[
        Path,
        typer.Argument(
            help="A CSV/TSV log with a header, JSONL, TensorBoard event files, or a run directory."
        ),
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    config: Annotated[Path | None, typer.Option(help="A YAML or TOML GuardConfig.")] = None,
    column: Annotated[str, typer.Option(help="The loss column.")] = "loss",
    step_column: Annotated[str, typer.Option(help="The step column.")] = "step",
    tag: Annotated[str | None, typer.Option(help="The TensorBoard scalar of the loss.")] = None,
) -> None:
    """Judge an existing loss log with the guard's detectors: exit 0 when healthy, 1 when
    incidents at warning or above were found, 2 on bad input."""
    import json

    from rich.table import Table

    from trainguard.analysis import analyze as run_analysis
    from trainguard.analysis import read_log

    cfg = GuardConfig.load(config) if config is not None else GuardConfig(console=False)
    data = read_log(path, loss_column=column, step_column=step_column, tag=tag)
    result = run_analysis(data, cfg)
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        for warning in data.warnings:
            err.print(f"[yellow]warning:[/] {warning}", highlight=False)
        table = Table(title=f"trainguard analyze {path}", title_justify="left")
        for name in ("step", "kind", "type", "severity", "magnitude", "what"):
            table.add_column(name, overflow="fold")
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
                e.message,
            )
        console = Console()
        console.print(table)
        s = result.summary
        verdict = (
            f"{len(result.incidents)} incident(s) at warning or above"
            if result.incidents
            else "healthy: no incident at warning or above"
        )
        console.print(
            f"{s['steps']} steps ({s['first_step']}..{s['last_step']}), final loss "
            f"{s['final_loss']:.4g}, loss spike score {s['spike_score']['loss']:.2e}: {verdict}"
        )
    if result.incidents:
        raise typer.Exit(1)


@app.command()
def report(
    source: Annotated[
        Path, typer.Argument(help="A run directory (metrics.jsonl, events.jsonl) or a loss log.")
    ],
    output: Annotated[Path, typer.Option("-o", "--output", help="The HTML file to write.")] = Path(
        "report.html"
    ),
    config: Annotated[
        Path | None, typer.Option(help="A GuardConfig to judge a bare log with.")
    ] = None,
    title: Annotated[str | None, typer.Option(help="The page title.")] = None,
) -> None:
    """Write one self-contained HTML report (plots, incident cards, lint, config) of a run or
    log; it opens offline in any browser."""
    from trainguard.analysis.run import load_run
    from trainguard.sinks.html_report import write_report

    cfg = GuardConfig.load(config) if config is not None else None
    record = load_run(source, cfg)
    if output.is_dir():
        raise TrainguardError(f"{output} is a directory: give the HTML file to write with -o")
    if not output.parent.exists():
        raise TrainguardError(f"{output.parent} does not exist: create it or choose another -o")
    path = write_report(record, output, title)
    incidents = sum(1 for e in record.events if e.get("severity") in ("warning", "critical"))
    err.print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MB, {incidents} warning+ events)")


@app.command()
def watch(
    run_dir: Annotated[Path, typer.Argument(help="The run directory of a running job.")],
    refresh: Annotated[float, typer.Option(help="Seconds between reads of its files.")] = 1.0,
    duration: Annotated[
        float | None, typer.Option(help="Stop after this many seconds (default: until Ctrl-C).")
    ] = None,
) -> None:
    """A live terminal dashboard of a running job: step, loss and grad-norm sparklines, health,
    the latest incidents. Stops by itself when the run halts."""
    import time

    from rich.live import Live

    from trainguard.analysis.watch import RunWatcher

    if not run_dir.is_dir():
        raise TrainguardError(f"{run_dir} is not a directory: give the run_dir of a Guard")
    watcher = RunWatcher(run_dir)
    start = time.monotonic()
    with Live(watcher.render(), console=Console(), refresh_per_second=4) as live:
        while True:
            watcher.poll()
            live.update(watcher.render())
            if watcher.halted or (duration is not None and time.monotonic() - start >= duration):
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
        float | None, typer.Option(help="The clip threshold the run uses; omit for none.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the findings as JSON.")] = False,
) -> None:
    """Lint a training set-up: exit 1 when a warning or worse is found, 0 when clean."""
    import json

    from rich.table import Table

    from trainguard.diagnosis.lint import lint
    from trainguard.events import SEVERITY_RANK

    setup = _load_setup(target)
    findings = lint(
        setup["model"],
        setup.get("optimizer"),
        setup.get("scheduler"),
        setup.get("scaler"),
        max_grad_norm,
        total_steps,
    )
    if as_json:
        typer.echo(json.dumps([f.to_dict() for f in findings], indent=1))
    elif not findings:
        Console().print("[green]no findings[/]")
    else:
        table = Table(title=f"trainguard lint {target}", title_justify="left")
        for column in ("severity", "code", "what", "fix"):
            table.add_column(column, overflow="fold")
        for f in findings:
            table.add_row(f.severity, f.code, f.message, f.fix)
        Console().print(table)
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
) -> None:
    """Scan a dataset offline for toxic samples and quarantine them for the guard."""
    from trainguard.diagnosis.scan import scan

    setup = _load_setup(target, ("model", "batches", "per_sample_loss_fn"))
    extra = {k: setup[k] for k in ("ids", "text") if k in setup}
    result = scan(
        setup["model"],
        setup["batches"],
        setup["per_sample_loss_fn"],
        z_threshold=z,
        perplexity=perplexity,
        quarantine_path=run_dir / "quarantine.jsonl",
        **extra,
    )
    console = Console()
    console.print(
        f"scanned {result.scanned} samples (median loss {result.median_loss:.4g}); "
        f"{len(result.flagged)} flagged"
        + (f" and quarantined in {result.quarantine}" if result.flagged else "")
    )
    for s in result.flagged[:20]:
        preview = f"  {s.preview!r}" if s.preview else ""
        console.print(f"  {s.id}: loss {s.loss:.4g} (z={s.z:.1f}){preview}", highlight=False)


def _load_setup(
    target: str, keys: tuple[str, ...] = ("model", "optimizer", "scheduler", "scaler")
) -> dict[str, Any]:
    import importlib
    import importlib.util
    import sys

    from torch import nn

    where, _, name = target.rpartition(":")
    if not where or not name:
        raise TrainguardError(f"lint needs MODULE:FUNCTION or FILE.py:FUNCTION, got {target!r}")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise TrainguardError(f"{path} not found: give the file that builds the set-up")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.parent.resolve()))
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise TrainguardError(f"cannot import {where}: {exc}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise TrainguardError(f"{where} has no function {name} that builds the set-up")
    built = factory()
    if isinstance(built, dict):
        setup = dict(built)
    elif isinstance(built, (tuple, list)):
        setup = dict(zip(keys, built, strict=False))
    else:
        setup = {"model": built}
    if not isinstance(setup.get("model"), nn.Module):
        raise TrainguardError(f"{target} must return a torch.nn.Module first (or under 'model')")
    return setup


@app.command()
def version() -> None:
    """Print the version."""
    typer.echo(__version__)


def main() -> None:
    """Entry point: run the app, turning trainguard's errors into one line and exit code 2."""
    try:
        app()
    except TrainguardError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        err.print("interrupted")
        raise SystemExit(130) from None
