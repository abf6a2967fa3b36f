"""The held-out corpus of real native logs (data/logs): labels, sources, halves and readers; the
OLMo and ms-swift stdout readers; and the scoring of benchmarks/real_logs.py."""

from __future__ import annotations

import csv
import gzip
import hashlib
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import real_logs as rl
from trainguard.analysis import read_log
from trainguard.events import TrainguardError

FOLDER = rl.FOLDER
SOURCE = re.compile(
    r"[\w.-]+/[\w.-]+@[0-9a-f]{40}:\S+|https://github\.com/[\w.-]+/[\w.-]+/issues/\d+"
)


def test_labels_index_every_log_and_each_reads_in_its_native_format_with_its_source():
    """labels.json names every file once; each reads with no warning (but the one a resumed run's
    steps going back give, exactly where the label says `resumed`), has a SOURCES.md entry,
    the half the sha256 rule gives it, spans inside its steps, and is unhealthy exactly when it
    lists incidents (each with its kind)."""
    labels = rl.load_labels()
    sources = (FOLDER / "SOURCES.md").read_text()
    files = sorted(p.name for p in FOLDER.iterdir() if p.name not in ("labels.json", "SOURCES.md"))
    assert sorted(labels) == files
    formats = set()
    for name, label in labels.items():
        data = read_log(FOLDER / name, loss_column=label.get("loss_column", "loss"))
        formats.add(data.format)
        resumed = [w for w in data.warnings if w.startswith("steps go back")]
        assert len(data.steps) and len(data.warnings) == len(resumed), (name, data.warnings)
        assert bool(resumed) == bool(label.get("resumed")), (name, "resumed", resumed)
        assert f"\n### {name}\n" in sources, f"{name} has no SOURCES.md entry"
        assert SOURCE.fullmatch(label["source"]), label["source"]
        even = int(hashlib.sha256(name.encode()).hexdigest(), 16) % 2 == 0
        assert label["half"] == ("tune" if even else "held_out") == rl.file_half(name), name
        assert label["healthy"] == (not label["instabilities"]), name
        assert len(label["kinds"]) == len(label["instabilities"]), name
        for key in ("instabilities", "outliers", "borderline"):
            for start, end in label[key]:
                assert data.steps[0] <= start <= end <= data.steps[-1], (name, key, start, end)
    native = {"olmo", "hf_stdout", "hf_trainer_state", "nanogpt", "llmc", "nanochat"}
    assert native | {"csv", "jsonl"} <= formats
    assert {label["half"] for label in labels.values()} == {"tune", "held_out"}


def test_olmo_blocks_give_one_row_per_step_with_grad_norm_lr_and_evaluation(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(
        "2025-12-12 11:05:02.009\thost:0\tolmo.train:979\tINFO\t[step=1/15000,epoch=0]\n"
        "    optim/total_grad_norm=0.2370\n"
        "    train/CrossEntropyLoss=2.998\n"
        "    throughput/total_tokens=2,097,152\n"
        "2025-12-12 11:05:05.850\thost:0\tolmo.train:979\tINFO\t[step=2/15000,epoch=0]\n"
        "    optim/learning_rate_group0=0.0003\n"
        "    train/CrossEntropyLoss=nan\n"
        "    eval/c4_en-validation/CrossEntropyLoss=3.25\n"
        "2025-12-12 11:05:09.701\thost:0\ttrain:375\tINFO\tSaving checkpoint...\n"
        "    train/CrossEntropyLoss=9.9\n"  # outside a step block: not a row
    )
    data = read_log(log)
    assert data.format == "olmo" and list(data.steps) == [1, 2]
    assert data.loss[0] == pytest.approx(2.998) and data.loss[1] != data.loss[1]  # NaN kept
    assert data.extra["grad_norm"][0] == pytest.approx(0.237)
    assert data.extra["lr"][1] == pytest.approx(3e-4)
    assert list(data.evals["step"]) == [2] and list(data.evals["loss"]) == [3.25]


def test_ms_swift_dicts_inside_progress_bar_redraws_are_read_with_their_step(tmp_path):
    log = tmp_path / "stdout.log"
    bar = "Train:   0%|          | 1/30 [00:05<02:33,  5.45s/it]"
    log.write_text(
        f"{bar}\r{bar} {{'loss': '1.921', 'grad_norm': '32.75', 'learning_rate': '4e-08', "
        "'epoch': '0.0002', 'global_step/max_steps': '1/30', 'elapsed_time': '6s'}\n"
        f"{bar}\r{{'loss': 2.714, 'grad_norm': 69, 'learning_rate': 8e-08, "
        "'global_step/max_steps': '2/30'}\n"
        "{'eval_loss': '1.5', 'eval_runtime': '3.1', 'global_step/max_steps': '2/30'}\n"
    )
    data = read_log(log)
    assert data.format == "hf_stdout" and list(data.steps) == [1, 2]
    assert list(data.loss) == pytest.approx([1.921, 2.714])
    assert list(data.extra["grad_norm"]) == pytest.approx([32.75, 69])
    assert list(data.extra["lr"]) == pytest.approx([4e-8, 8e-8])
    assert list(data.evals["loss"]) == [1.5]


def test_the_benchmark_finds_a_nan_and_counts_an_alarm_off_the_labels_as_false(tmp_path):
    """The NaN of the nanoGPT log is found; the same log labelled clean counts its alarm as a
    false one, and a clean log with an alarm fails the clean-log target of its half."""
    name = "nanogpt-shakespeare-char-nan.log"
    label = rl.load_labels()[name]
    found = rl.judge(FOLDER / name, label)
    assert found.verdict == "found" and found.found == [(425, 450)] and not found.false_alarms
    clean = rl.judge(FOLDER / name, {**label, "healthy": True, "instabilities": []})
    assert clean.verdict == "FALSE ALARM" and clean.false_alarms
    score = rl.summary([clean])
    assert score["clean logs alarmed"] == 1 and not score["clean alarmed share ok"]
    missing = rl.judge(tmp_path / "absent.log", label)
    assert missing.verdict == "unread" and missing.missed == [(425, 450)]


def test_a_resumed_jax_log_keeps_each_replayed_steps_last_row_under_its_named_loss_column():
    """The birdjepa CSV (steps go back ~260 at each of its resumes) reads with the label's
    `loss_column`: one row a step, the later segment's value kept, the replayed rows set apart;
    without the column named, the benchmark reports it unread."""
    name = "jax-birdjepa-resume-seed2.csv.gz"
    label = rl.load_labels()[name]
    data = read_log(FOLDER / name, loss_column=label["loss_column"])
    with gzip.open(FOLDER / name, "rt", newline="") as f:
        rows = list(csv.DictReader(f))
    last = {int(r["step"]): float(r["loss_ce"]) for r in rows}  # later rows overwrite
    assert list(data.steps) == sorted(last)
    assert list(data.loss) == pytest.approx([last[s] for s in sorted(last)])
    replayed = set(int(s) for s in data.abandoned["step"])
    assert len(replayed) > 100 and replayed <= set(last)
    assert len(rows) == len(last) + len(data.abandoned["step"])
    unnamed = rl.judge(FOLDER / name, {k: v for k, v in label.items() if k != "loss_column"})
    assert unnamed.verdict == "unread" and unnamed.missed == [(4505, 4600)]


def test_nanochat_base_training_is_read_and_the_speedruns_later_stages_are_not(tmp_path):
    """nanochat's base_train lines (one with a terminal's echoed `^[[A` before it) and their
    validation bpb are read; mid-training's lines and evaluations after them are not; nanoswe's
    line is this format too; a file with no such line is refused in one line."""
    log = tmp_path / "speedrun.log"
    log.write_text(
        "Step 00000 | Validation bpb: 3.3013\n"
        "step 00000/00003 (0.00%) | loss: 11.090355 | grad norm: 0.4282 | lrm: 1.00 | dt: 1ms\n"
        "^[[A^[[Astep 00001/00003 (33.33%) | loss: 10.808654 | lrm: 1.00 | dt: 639.21ms\n"
        "\x1b[2Kstep 00002/00003 (66.67%) | loss: nan | grad norm: inf | lrm: 0.50 | dt: 1ms\r"
        "Step 00003 | Validation bpb: 1.2016\n"
        "Step 00000 | Validation bpb: 0.6886\n"  # mid-training's: a later stage
        "step 00000/00003 (0.00%) | loss: 1.5 | lrm: 1.00 | dt: 1ms\n"
        "step 00770 (99.83%) | loss: 1.305023 | lrm: 0.01 | dt: 934.21ms\n"
    )
    data = read_log(log)
    assert data.format == "nanochat" and list(data.steps) == [0, 1, 2]
    assert data.loss[:2] == pytest.approx([11.090355, 10.808654]) and data.loss[2] != data.loss[2]
    assert data.extra["grad_norm"][0] == pytest.approx(0.4282)
    assert list(data.evals["step"]) == [0, 3] and list(data.evals["loss"]) == [3.3013, 1.2016]
    fork = tmp_path / "nanoswe.log"
    fork.write_text(
        "[2026-06-25 19:33:47] step 000000 | loss 10.398314 | lrm 0.0250 | dt_ms 54852.9\n"
        "[2026-06-25 19:33:56] step 000001 | loss 10.340952 | lrm 0.0500 | dt_ms 8124.4\n"
    )
    assert read_log(fork).format == "nanochat" and list(read_log(fork).steps) == [0, 1]
    other = tmp_path / "other.log"
    other.write_text("step 00770 (99.83%) | loss: 1.305023 | lrm: 0.01\n")
    with pytest.raises(TrainguardError, match=r"^[^\n]*no line of the nanochat format"):
        read_log(other, format="nanochat")
