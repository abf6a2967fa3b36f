"""The `trainguard` command line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.console import Console

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
    steps: Annotated[int, typer.Option(help="Training steps.")] = 300,
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
def version() -> None:
    """Print the version."""
    typer.echo(__version__)


def main() -> None:
    """Entry point: run the app, turning trainguard's errors into one line and exit code 2."""
    try:
        app()
    except TrainguardError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        err.print("interrupted")
        raise SystemExit(130) from None
