"""Memory stays bounded on any input: `analyze` thins a log past `MAX_ROWS` rows and passes over
lines too long to hold; `watch` reads with a bounded buffer, follows a replaced file, and judges
a writer by its lock, not only its pid (issue 34)."""

from __future__ import annotations

import fcntl
import gzip
import io
import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest

from trainguard.analysis import RunWatcher, logs
from trainguard.analysis.analyzer import analyze
from trainguard.analysis.logs import BoundedLines, read_log
from trainguard.events import TrainguardError
from trainguard.run_lock import LOCK_NAME, RunLock, local_holder

ROWS = 200_000
NAN_AT, SPIKE_AT = 100_003, 150_001


def curve(rows: int = ROWS) -> np.ndarray:
    """A slowly falling, slightly noisy loss with one NaN and one spike in its middle."""
    rng = np.random.default_rng(0)
    loss = 3.0 - np.arange(rows) * 1e-6 + rng.normal(0.0, 0.01, rows)
    if rows > SPIKE_AT:
        loss[NAN_AT] = np.nan
        loss[SPIKE_AT] = 30.0
    return loss


def gz_csv(path: Path, loss: np.ndarray) -> Path:
    text = "".join(f"{i},{v:.5f},1.0\n" for i, v in enumerate(loss.tolist()))
    with gzip.open(path, "wt") as f:
        f.write("step,loss,grad_norm\n" + text)
    return path


@pytest.fixture(scope="module")
def big_gz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gz_csv(tmp_path_factory.mktemp("big") / "metrics.csv.gz", curve())


def test_a_gz_csv_over_the_row_limit_is_thinned_and_keeps_its_nan_and_spike(big_gz, monkeypatch):
    monkeypatch.setattr(logs, "MAX_ROWS", 5_000)
    monkeypatch.setattr(logs, "BLOCK_BYTES", 1 << 16)  # many blocks: thinned as they stream
    data = read_log(big_gz)
    assert len(data.steps) <= 5_000
    note = data.warnings[0]
    assert note.startswith("metrics.csv.gz: 200,000 rows, over the limit of 5,000; judged ")
    assert f"judged {len(data.steps):,} of them: every 128th" in note
    assert NAN_AT in data.steps and SPIKE_AT in data.steps
    assert np.isnan(data.loss[data.steps == NAN_AT]).all()
    found = {(e.step, e.kind) for e in analyze(data).incidents}
    assert (NAN_AT, "nonfinite") in found and (SPIKE_AT, "loss_spike") in found


def test_thinning_while_streaming_keeps_what_thinning_at_once_keeps(big_gz, monkeypatch):
    monkeypatch.setattr(logs, "MAX_ROWS", 3_000)
    whole = read_log(big_gz)  # one block
    monkeypatch.setattr(logs, "BLOCK_BYTES", 1 << 16)
    streamed = read_log(big_gz)
    assert np.array_equal(whole.steps, streamed.steps)
    assert np.array_equal(whole.loss, streamed.loss, equal_nan=True)


def test_a_log_under_the_limit_is_read_whole(big_gz, monkeypatch):
    monkeypatch.setattr(logs, "MAX_ROWS", ROWS)
    data = read_log(big_gz)
    assert len(data.steps) == ROWS and not any("over the limit" in w for w in data.warnings)


def test_jsonl_and_text_logs_are_thinned_as_they_stream(tmp_path, monkeypatch):
    monkeypatch.setattr(logs, "MAX_ROWS", 2_000)
    monkeypatch.setattr(logs, "FLUSH_ROWS", 1_000)
    loss = curve(50_000)
    loss[40_000] = np.nan
    lines = [json.dumps({"step": i, "loss": v if v == v else "nan"}) for i, v in enumerate(loss)]
    (tmp_path / "run.jsonl").write_text("\n".join(lines) + "\n")
    text = "".join(f"iter {i}: loss {v:.4f}, time 10.0ms\n" for i, v in enumerate(loss))
    (tmp_path / "train.log").write_text(text)
    for name in ("run.jsonl", "train.log"):
        data = read_log(tmp_path / name)
        assert len(data.steps) <= 2_000, name
        assert data.warnings[0].startswith(f"{name}: 50,000 rows, over the limit of 2,000")
        assert 40_000 in data.steps and np.isnan(data.loss[data.steps == 40_000]).all()


def test_a_line_of_several_mib_is_passed_over_unread(tmp_path):
    rows = [json.dumps({"step": i, "loss": 2.0}) for i in range(20)]
    huge = '{"step": 20, "loss": 2.0, "note": "' + "x" * (3 << 20) + '"}'
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join([*rows[:10], huge, *rows[10:]]) + "\n" + huge[: 2 << 20])
    data = read_log(path)
    assert len(data.steps) == 20 and 20 not in data.steps
    assert any("passed over 2 line(s) longer than 1,048,576 bytes" in w for w in data.warnings)
    reader = BoundedLines(io.BytesIO(b"a\n" + b"y" * 5000 + b"\nb"), limit=100)
    assert list(reader) == [b"a", b"b"] and reader.long == 1 and reader.unfinished


def trainer_state(entries: list[dict[str, object]]) -> str:
    return json.dumps({"best_metric": None, "log_history": entries, "global_step": len(entries)})


def test_a_trainer_state_over_the_limit_is_streamed_and_thinned(tmp_path, monkeypatch):
    monkeypatch.setattr(logs, "MAX_ROWS", 1_000)
    monkeypatch.setattr(logs, "FLUSH_ROWS", 500)
    monkeypatch.setattr(logs, "READ_BYTES", 4096)  # the document read through a small window
    loss = curve(20_000)
    loss[12_345] = np.nan
    entries: list[dict[str, object]] = [
        {"step": i + 1, "loss": float(v), "learning_rate": 1e-4} for i, v in enumerate(loss)
    ]
    entries += [{"step": 20_000, "eval_loss": 2.5}]
    path = tmp_path / "trainer_state.json"
    path.write_text(trainer_state(entries))  # NaN as Python's json writes it
    data = read_log(path)
    assert len(data.steps) <= 1_000 and data.steps[0] == 1
    assert data.warnings[0].startswith("trainer_state.json: 20,000 rows, over the limit of 1,000")
    assert np.isnan(data.loss[data.steps == 12_346]).all()
    assert list(data.evaluations["eval_loss"][1]) == [2.5]


def test_a_trainer_state_entry_too_long_to_hold_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setattr(logs, "MAX_LINE_BYTES", 10_000)
    monkeypatch.setattr(logs, "READ_BYTES", 4096)
    path = tmp_path / "trainer_state.json"
    path.write_text(trainer_state([{"step": 1, "loss": 2.0, "note": "x" * 50_000}]))
    with pytest.raises(TrainguardError, match="a value of over 10,000 bytes"):
        read_log(path)
    path.write_text(trainer_state([{"step": 1, "loss": 2.0}])[:-20])  # cut short
    with pytest.raises(TrainguardError, match=r"not a readable trainer_state\.json"):
        read_log(path)


def write_steps(path: Path, steps: range) -> None:
    path.write_text("".join(json.dumps({"step": s, "loss": 2.0}) + "\n" for s in steps))


def test_watch_reads_a_replaced_or_truncated_file_from_its_start(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write_steps(metrics, range(2000))
    watcher = RunWatcher(tmp_path)
    watcher.poll()
    assert watcher.step == 1999
    write_steps(tmp_path / "new.jsonl", range(10))
    os.replace(tmp_path / "new.jsonl", metrics)  # another inode
    watcher.poll()
    assert watcher.step == 9 and len(watcher.loss) == 10
    assert "metrics.jsonl was replaced or truncated: read again from its start" in watcher.line()
    write_steps(metrics, range(5))  # the same inode, truncated
    watcher.poll()
    assert watcher.step == 4 and watcher._metrics.reread == 2


def test_watch_holds_no_more_than_the_line_limit_of_a_line_without_newline(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write_steps(metrics, range(3))
    watcher = RunWatcher(tmp_path)
    watcher.poll()
    with metrics.open("a") as f:
        f.write('{"step": 3, "loss": 2.0, "x": "' + "x" * (5 << 20))  # 5 MiB, no newline yet
    watcher.poll()
    assert len(watcher._metrics.partial) <= logs.MAX_LINE_BYTES
    with metrics.open("a") as f:
        f.write('"}\n{"step": 4, "loss": 2.0}\n')
    watcher.poll()
    assert watcher.step == 4 and list(watcher.loss) == [2.0] * 4
    assert "passed over 1 line(s) of metrics.jsonl over 1,048,576 bytes" in watcher.line()


def unlocked_record(run_dir: Path, pid: int) -> None:
    run_dir.mkdir(exist_ok=True)
    record = {"pid": pid, "host": socket.gethostname(), "since": "2026-01-01T00:00:00Z"}
    (run_dir / LOCK_NAME).write_text(json.dumps(record) + "\n")


def test_a_live_pid_that_holds_no_lock_is_a_writer_that_exited(tmp_path):
    """A killed run's pid taken by another process (here: this test's own, alive) is still
    said to have exited: no process holds the folder's lock."""
    write_steps(tmp_path / "metrics.jsonl", range(3))
    unlocked_record(tmp_path, os.getpid())
    assert local_holder(tmp_path) == (os.getpid(), False)
    watcher = RunWatcher(tmp_path)
    watcher.poll()
    assert not watcher.writer_alive
    assert f"its writer (pid {os.getpid()}) exited without closing the run" in watcher.line()
    lock = RunLock.take(tmp_path)  # a live writer holds it
    assert lock is not None
    try:
        assert local_holder(tmp_path) == (os.getpid(), True)
    finally:
        lock.release()


def test_a_watchers_probe_never_makes_a_writer_fail_to_take_the_lock(tmp_path, monkeypatch):
    unlocked_record(tmp_path, os.getpid())
    probe = os.open(tmp_path / LOCK_NAME, os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a watcher's probe, at the wrong moment
    waits: list[float] = []

    def probe_ends(seconds: float) -> None:
        waits.append(seconds)
        fcntl.flock(probe, fcntl.LOCK_UN)

    monkeypatch.setattr("trainguard.run_lock.time.sleep", probe_ends)
    try:
        lock = RunLock.take(tmp_path)
        assert lock is not None and lock.held and len(waits) == 1
        lock.release()
    finally:
        os.close(probe)


def test_a_tensorboard_scalar_over_the_limit_is_a_bounded_sample_said_so(tmp_path, monkeypatch):
    from torch.utils.tensorboard import SummaryWriter

    monkeypatch.setattr(logs, "MAX_ROWS", 500)
    writer = SummaryWriter(str(tmp_path / "tb"))
    for step in range(2000):
        writer.add_scalar("train/loss", 3.0 - step * 1e-4, step)
    writer.close()
    data = read_log(tmp_path / "tb")
    assert len(data.steps) == 500 and data.steps[-1] == 1999
    assert "judged TensorBoard's uniform sample of 500" in data.warnings[1]


def test_a_csv_row_too_long_to_hold_is_read_from_its_first_cells(tmp_path, monkeypatch):
    monkeypatch.setattr(logs, "BLOCK_BYTES", 1 << 16)
    rows = "".join(f"{i},2.0,n\n" for i in range(10))
    path = tmp_path / "train.csv"
    path.write_text("step,loss,note\n" + rows + "10,9.0," + "x" * (3 << 20) + "\n11,2.0,n\n")
    data = read_log(path)
    assert list(data.steps) == list(range(12)) and data.loss[10] == 9.0
    assert "read 1 row(s) longer than 1,048,576 bytes" in data.warnings[0]


def test_many_thinned_evaluations_are_said_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(logs, "MAX_EVAL_ROWS", 100)
    names = ["eval_loss", "eval_acc", "eval_f1", "eval_bleu"]
    lines = [json.dumps({"step": i, "loss": 2.0, **dict.fromkeys(names, 0.5)}) for i in range(500)]
    (tmp_path / "run.jsonl").write_text("\n".join(lines) + "\n")
    data = read_log(tmp_path / "run.jsonl")
    assert data.warnings == [
        "run.jsonl: 4 evaluations over the limit of 100 values each (eval_loss, eval_acc, "
        "eval_bleu, eval_f1); each judged on a thinning that keeps its highest, lowest and first "
        "and last non-finite values"
    ]
    assert all(len(steps) <= 100 for steps, _ in data.evaluations.values())


def test_a_thinned_metrics_jsonl_keeps_the_precursors_of_its_kept_steps_only(tmp_path, monkeypatch):
    monkeypatch.setattr(logs, "MAX_ROWS", 1_000)
    monkeypatch.setattr(logs, "FLUSH_ROWS", 500)
    probe = {"attn_max_logit": {"layer0": 5.0}}
    lines = [
        json.dumps({"step": i, "loss": 2.0, **({"precursors": probe} if i % 10 == 0 else {})})
        for i in range(20_000)
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    data = read_log(tmp_path / "metrics.jsonl")
    assert data.precursors is not None and len(data.precursors) == len(data.steps) <= 1_000
    assert [p is not None for p in data.precursors] == [s % 10 == 0 for s in data.steps]


def test_without_locks_a_reused_pid_is_told_by_its_start_time(tmp_path, monkeypatch):
    """Where the file system cannot lock, the start time the writer recorded tells its pid, now
    another process's (here: this test's), from the writer."""
    from trainguard import run_lock

    monkeypatch.setattr(run_lock, "lock_held", lambda fd: None)
    started = run_lock.start_time(os.getpid())
    assert started is not None
    for recorded, alive in ((started, True), (started + 1, False)):
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": recorded}
        (tmp_path / LOCK_NAME).write_text(json.dumps(record) + "\n")
        assert local_holder(tmp_path) == (os.getpid(), alive)
    lock = RunLock.take(tmp_path)
    assert lock is not None
    try:
        assert json.loads((tmp_path / LOCK_NAME).read_text())["started"] == started
    finally:
        lock.release()
