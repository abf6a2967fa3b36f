"""Links and FIFOs planted in a run folder (issue 34): nothing outside the run folder is written,
truncated or deleted through them, and the user is told in one line what to do."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import trainguard as tg
from checkpoint_damage import tiny_config, tiny_setup, train
from trainguard.actions.checkpoints import CheckpointStore
from trainguard.actions.quarantine import Quarantine
from trainguard.run_files import RunFileError, create_temporary, remove_tree, write_atomically

# no newline at its end: the old "torn last line" repair cut all of it off
PRECIOUS = b'{"step": 1}\n' * 330 + b"the last line of someone else's file"
FIX = "trainguard never writes or reads through it: remove it or choose another run_dir"


@pytest.fixture
def target(tmp_path: Path) -> Path:
    """A file outside the run folder, with known bytes, that an attacker aims a link at."""
    path = tmp_path / "elsewhere" / "precious.bin"
    path.parent.mkdir()
    path.write_bytes(PRECIOUS)
    return path


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    return path


def start_guard(run_dir: Path) -> tg.Guard:
    model, opt = tiny_setup()
    return tg.Guard(model, opt, config=tiny_config(), run_dir=run_dir)


def within(seconds: float, call: Callable[[], Any]) -> BaseException | None:
    """What `call` raised (None if nothing), failing the test if it has not returned in time."""
    raised: list[BaseException | None] = [None]

    def body() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the test
            raised[0] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "it hung on a FIFO"
    return raised[0]


@pytest.mark.parametrize(
    "name", [".lock", "metrics.jsonl", "events.jsonl", "quarantine.jsonl", "config.json"]
)
def test_a_link_planted_as_a_run_file_is_one_error_and_its_target_is_untouched(
    run_dir: Path, target: Path, name: str
) -> None:
    (run_dir / name).symlink_to(target)
    with pytest.raises(tg.TrainguardError) as caught:
        start_guard(run_dir)
    assert str(caught.value) == f"{run_dir / name} is a symbolic link; {FIX}"
    assert target.read_bytes() == PRECIOUS
    assert (run_dir / name).is_symlink()


@pytest.mark.parametrize("name", [".lock", "metrics.jsonl", "events.jsonl"])
def test_a_hard_link_planted_as_a_run_file_is_one_error_and_its_target_is_untouched(
    run_dir: Path, target: Path, name: str
) -> None:
    """A hard link (a run folder copied with `cp -al`, or planted) shares its bytes with another
    file: appending or cutting it would change that one too."""
    os.link(target, run_dir / name)
    with pytest.raises(tg.TrainguardError) as caught:
        start_guard(run_dir)
    assert str(caught.value) == (
        f"{run_dir / name} is a file with 2 hard links (another file's too); {FIX}"
    )
    assert target.read_bytes() == PRECIOUS


@pytest.mark.parametrize("name", [".lock", "metrics.jsonl", "quarantine.jsonl"])
def test_a_fifo_planted_as_a_run_file_is_one_error_not_a_hang(run_dir: Path, name: str) -> None:
    os.mkfifo(run_dir / name)
    raised = within(30, lambda: start_guard(run_dir))
    assert isinstance(raised, tg.TrainguardError)
    assert str(raised) == f"{run_dir / name} is a FIFO, not a regular file; {FIX}"


def test_evals_jsonl_planted_as_a_link_is_said_and_training_goes_on(
    run_dir: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (run_dir / "evals.jsonl").symlink_to(target)
    guard = start_guard(run_dir)
    model = guard.model
    assert model is not None
    train(guard, model, 3)
    guard.evaluate(3, {"val_loss": 1.0})
    train(guard, model, 5)
    guard.close()
    assert target.read_bytes() == PRECIOUS
    assert f"{run_dir / 'evals.jsonl'} is a symbolic link; {FIX}" in capsys.readouterr().err


def test_config_temporaries_are_unpredictable_so_planted_names_catch_nothing(
    run_dir: Path, target: Path
) -> None:
    planted = [run_dir / f".config.json.tmp-{os.getpid() + i}" for i in range(20)]
    for link in planted:
        link.symlink_to(target)
    start_guard(run_dir).close()
    assert target.read_bytes() == PRECIOUS
    assert all(link.is_symlink() for link in planted)
    assert tg.GuardConfig.load(run_dir / "config.json").console is False
    names = {create_temporary(run_dir, ".config.json.tmp-")[1].name for _ in range(2)}
    assert len(names) == 2 and all(
        re.fullmatch(r"\.config\.json\.tmp-[0-9a-f]{16}", n) for n in names
    )


def test_a_checkpoint_folder_that_is_a_link_has_only_its_link_removed(
    tmp_path: Path, run_dir: Path
) -> None:
    elsewhere = tmp_path / "someone-elses-checkpoint"
    elsewhere.mkdir()
    (elsewhere / "manifest.json").write_text('{"step": 5}')
    (elsewhere / "weights.bin").write_bytes(PRECIOUS)
    store = CheckpointStore(run_dir / "checkpoints", keep=1, asynchronous=False, dedup=False)
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "step-5").symlink_to(elsewhere)
    for step in (10, 20):  # retention keeps one: step-10 and the linked step-5 go
        store.save(step, {"w": torch.full((2,), float(step))}, {}, {})
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-20"]
    assert (elsewhere / "weights.bin").read_bytes() == PRECIOUS
    assert (elsewhere / "manifest.json").read_text() == '{"step": 5}'
    link = run_dir / "checkpoints" / "step-5"
    assert store.errors == [
        f"{link} was a symbolic link: removed the link only, not what it points to"
    ]


def test_checkpoints_folder_planted_as_a_link_is_refused_at_the_start(
    tmp_path: Path, run_dir: Path
) -> None:
    elsewhere = tmp_path / "elsewhere-checkpoints"
    (elsewhere / "step-10").mkdir(parents=True)
    (run_dir / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(tg.TrainguardError) as caught:
        start_guard(run_dir)
    assert str(caught.value) == f"{run_dir / 'checkpoints'} is a symbolic link; {FIX}"
    assert [p.name for p in elsewhere.iterdir()] == ["step-10"]
    assert list(run_dir.iterdir()) == [run_dir / "checkpoints"]  # refused before the lock


def test_remove_tree_removes_links_inside_as_links(tmp_path: Path, target: Path) -> None:
    doomed = tmp_path / "doomed"
    doomed.mkdir()
    (doomed / "link").symlink_to(target.parent)
    said: list[str] = []
    remove_tree(doomed, said.append)
    assert not doomed.exists() and target.read_bytes() == PRECIOUS and said == []


def test_deepspeed_write_atomically_neither_follows_its_temporary_nor_its_target(
    tmp_path: Path, target: Path
) -> None:
    deepspeed = pytest.importorskip("trainguard.integrations.deepspeed")
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / ".latest.tmp").symlink_to(target)  # the old, fixed temporary name
    (folder / "step-4").mkdir()
    (folder / "step-4" / ".trainguard-rank0.json.tmp").symlink_to(target)
    deepspeed._write_atomically(folder / "latest", "step-4")
    deepspeed._write_atomically(folder / "step-4" / "trainguard-rank0.json", "{}")
    assert (folder / "latest").read_text() == "step-4"
    assert (folder / "step-4" / "trainguard-rank0.json").read_text() == "{}"
    (folder / "latest").unlink()
    (folder / "latest").symlink_to(target)
    with pytest.raises(RunFileError) as caught:
        deepspeed._write_atomically(folder / "latest", "step-8")
    assert str(caught.value) == f"{folder / 'latest'} is a symbolic link; {FIX}"
    assert target.read_bytes() == PRECIOUS
    assert sorted(p.name for p in folder.iterdir()) == [".latest.tmp", "latest", "step-4"]


def test_write_atomically_leaves_nothing_behind_when_the_write_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(fd: int) -> Any:
        os.close(fd)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_atomically(tmp_path / "a.json", b"{}", refuse)
    assert list(tmp_path.iterdir()) == []


def test_a_link_planted_over_quarantine_jsonl_mid_run_is_said_and_its_record_kept(
    run_dir: Path, target: Path
) -> None:
    said: list[str] = []
    path = run_dir / "quarantine.jsonl"
    quarantine = Quarantine(path, said.append)
    quarantine.add(3, "loss spike", 9.0, ["b3"])
    path.unlink()  # the file is reopened for each record: the link is met at the next one
    path.symlink_to(target)
    quarantine.add(7, "loss spike", 9.0, ["b7"])
    quarantine.close()
    assert target.read_bytes() == PRECIOUS
    assert quarantine.contains(["b7"]) and quarantine.unwritten == 1
    assert said[0].startswith(f"{path} is a symbolic link; {FIX}; keeping its lines")
