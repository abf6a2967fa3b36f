"""Native log formats, read from real excerpts of public runs (tests/data/native_logs, with
their sources in SOURCES.md): each found by content, with the values the file prints, its
evaluations apart, its NaN and restarts; and `analyze` over them as a user runs it."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainguard.analysis import analyze, read_log
from trainguard.analysis.formats import names
from trainguard.analysis.logs import read_runs
from trainguard.events import TrainguardError

LOGS = Path(__file__).parent / "data" / "native_logs"

# file, format, training rows, (first step, its loss), columns besides the loss, evaluations
EXPECTED = [
    (
        "hf_trainer_state/trl_sft_tinyllama_trainer_state.json",
        "hf_trainer_state",
        186,
        (15, 2.0762),
        {"grad_norm", "lr", "token_accuracy"},  # TRL's mean_token_accuracy
        14,
    ),
    (
        "hf_trainer_state/whisper_seq2seq_trainer_state_no_grad_norm.json",
        "hf_trainer_state",
        200,
        (25, 0.3048),
        {"lr"},
        5,
    ),
    ("lightning_csv/gpttt_version_0_metrics.csv", "lightning_csv", 10, (49, 2.62029362), set(), 2),
    (
        "lightning_csv/slm_training_version_0_metrics.csv",
        "lightning_csv",
        197,
        (49, 7.62858057),
        set(),
        2,
    ),
    (
        "megatron/megatron_lm_resume_from_14000_srun_prefixed.log",
        "megatron",
        19,
        (14001, 2.399058),
        {"grad_norm", "lr", "loss_scale"},
        0,
    ),
    (
        "deepspeed/megatron_deepspeed_steps_loss_iter_time_qwen7b.log",
        "megatron",
        128,
        (1, 12.63599),
        {"grad_norm", "lr", "loss_scale"},
        1,
    ),
    (
        "wandb_csv/chatterbox_tts_run_history_export_step_runtime.csv",
        "wandb_csv",
        41,
        (1, 0.17817425727844238),
        {"lr"},
        8,
    ),
    (
        "torchtitan/torchtitan_ansi_resume_from_step12500_with_validate.log",
        "torchtitan",
        152,
        (12510, 3.12458),
        {"grad_norm"},
        2,
    ),
    (
        "torchtitan/torchtitan_ansi_llama3_150m_from_step1.log",
        "torchtitan",
        103,
        (1, 12.26907),
        {"grad_norm"},
        0,
    ),
    (
        "llmc/llmc_main_log_gpt2_124M_modded_nanogpt_record.log",
        "llmc",
        298,
        (0, 11.0091),
        {"grad_norm", "lr"},
        3,
    ),
    (
        "nemo/nemo2_evo2_finetune_stdout_notebook_export.log",
        "nemo",
        10,
        (0, 1.371),
        {"lr"},
        1,
    ),
    (
        "nanogpt/nanogpt_train_py_stdout_keyboardinterrupt.log",
        "nanogpt",
        255,
        (0, 10.9766),
        set(),
        2,
    ),
    ("nanogpt/build_nanogpt_log_txt_linear_lr.log", "build_nanogpt", 264, (0, 10.95501), set(), 3),
    (
        "nanogpt/build_nanogpt_stdout_linear_lr.log",
        "build_nanogpt",
        268,
        (0, 10.95501),
        {"grad_norm", "lr"},
        2,
    ),
    (
        "modded_nanogpt/modded_nanogpt_2024-10-10_Muon_eb5659d0.txt",
        "modded_nanogpt",
        266,
        (1, 10.9184),
        set(),
        4,
    ),
]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainguard", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(("name", "fmt", "rows", "first", "extra", "evals"), EXPECTED)
def test_each_native_log_is_found_by_content_with_its_values(name, fmt, rows, first, extra, evals):
    data = read_log(LOGS / name)
    assert data.format == fmt and len(data.steps) == rows
    assert (int(data.steps[0]), float(data.loss[0])) == pytest.approx(first)
    assert set(data.extra) == extra
    assert len(data.evals.get("step", ())) == evals
    assert not data.warnings  # evaluation rows and other lines are not "bad rows"
    assert np.all(np.diff(data.steps) > 0)


def test_torchtitan_keeps_validation_apart_and_drops_colour_codes():
    data = read_log(LOGS / "torchtitan/torchtitan_ansi_resume_from_step12500_with_validate.log")
    at = int(np.flatnonzero(data.steps == 13000)[0])
    assert data.loss[at] == pytest.approx(3.46973)  # the training line, not `validate step`
    assert data.extra["grad_norm"][at] == pytest.approx(0.0276)
    assert list(data.evals["step"]) == [13000, 14000]
    assert list(data.evals["loss"]) == pytest.approx([3.3539, 3.3315])


def test_a_lightning_loss_that_turns_nan_is_a_critical_incident():
    """Every loss of this PINN run is `nan` from step 218: analyze says so, exit 1."""
    log = LOGS / "lightning_csv/pinn_version_14_metrics_with_nan.csv"
    data = read_log(log)
    assert data.format == "lightning_csv" and np.isnan(data.loss[data.steps >= 218]).all()
    result = analyze(data)
    nonfinite = [e for e in result.events if e.kind == "nonfinite"]
    assert [(e.step, e.severity) for e in nonfinite] == [(218, "critical")]
    out = cli("analyze", str(log))
    assert out.returncode == 1 and "lightning_csv" in out.stdout


def test_a_wandb_panel_export_is_judged_run_by_run(tmp_path):
    log = LOGS / "wandb_csv/nanogpt_panel_export_8runs_train_loss_MIN_MAX.csv"
    runs = read_runs(log)
    assert len(runs) == 8 and all(r.format == "wandb_csv" for r in runs)
    assert len({r.run for r in runs}) == 8
    with pytest.raises(TrainguardError, match="holds 8 runs"):
        read_log(log)
    one = read_log(log, run=runs[5].run)
    assert list(one.steps) == list(runs[5].steps)
    out = cli("analyze", str(log), "--json")
    judged = json.loads(out.stdout)["runs"]
    assert [r["run"] for r in judged] == [r.run for r in runs]
    assert out.returncode == (1 if any(r["events"] for r in judged) else 0)
    page = tmp_path / "report.html"
    report = cli("report", str(log), "--run", str(runs[5].run), "-o", str(page))
    assert report.returncode == 0 and str(runs[5].run) in page.read_text()
    refused = cli("report", str(log), "-o", str(page))
    assert refused.returncode == 2 and "holds 8 runs" in refused.stderr


def test_a_wandb_run_history_export_reads_its_loss_spike():
    """A run's history as `run.history().to_csv()` writes it: an unnamed index column, `_step`,
    `train/loss` empty on the first row (only `trainable_parameters` was logged then), and
    `eval/loss` every 5 steps. Its loss jumps 2.6x at step 37: analyze says so, exit 1."""
    log = LOGS / "wandb_csv/chatterbox_tts_run_history_export_step_runtime.csv"
    data = read_log(log)
    assert data.loss[data.steps == 37][0] == pytest.approx(0.49679362773895264)
    assert list(data.evals["step"]) == [5, 10, 15, 20, 25, 30, 35, 40]
    assert data.extra["lr"][0] == 0.0 and data.extra["lr"][-1] == pytest.approx(1.0133e-05, 1e-4)
    spikes = [e for e in analyze(data).events if e.kind == "loss_spike"]
    assert [e.step for e in spikes] == [37]
    assert cli("analyze", str(log)).returncode == 1


def test_a_megatron_log_whose_training_starts_again_keeps_the_last_pass():
    """One Slurm log of four passes of the same 300-iteration training, each from iteration 1
    (the excerpt keeps the first pass's iterations 1-7 and 298-300, the second's 1-8): the
    second pass's rows are the run's, the first pass's rows of the same steps kept apart."""
    log = LOGS / "megatron/megatron_lm_4_passes_restart_from_iteration_1_srun_prefixed.log"
    data = read_log(log)
    assert data.format == "megatron"
    assert list(data.steps) == [1, 2, 3, 4, 5, 6, 7, 8, 298, 299, 300]
    assert list(data.abandoned["step"]) == [1, 2, 3, 4, 5, 6, 7]
    assert data.loss[0] == pytest.approx(12.17229)  # the second pass's iteration 1
    assert data.abandoned["loss"][0] == pytest.approx(12.17231)  # the first pass's
    assert data.loss[-1] == pytest.approx(4.317102)
    assert data.warnings == [
        "steps go back or repeat (a restart, or a rollback's replay): kept the last row of each "
        "step, the earlier ones apart as abandoned"
    ]


def test_format_forces_a_reader_and_an_unknown_one_is_listed():
    log = LOGS / "deepspeed/megatron_deepspeed_steps_loss_iter_time_qwen7b.log"
    forced = read_log(log, format="deepspeed")  # its `steps: N loss: X` lines
    assert forced.format == "deepspeed" and forced.loss[0] == pytest.approx(12.6360)
    assert len(forced.steps) == 129
    out = cli("analyze", str(log), "--format", "nosuch")
    assert out.returncode == 2 and "no log format 'nosuch'" in out.stderr
    assert all(n in out.stderr for n in names())


def test_deepspeed_reads_the_lr_of_its_step_line_into_the_lr_column(tmp_path):
    """DeepSpeed prints `[Rank 0] step=N, skipped=K, lr=[x, y], mom=[...]` on a line of its own,
    beside `steps: N loss: X`: the first group's LR is step N's LR, printed before its loss line
    (as here) or after it."""
    log = LOGS / "deepspeed/deepspeed_rank0_step_skipped_lr_pdsh_prefixed.log"
    data = read_log(log, format="deepspeed")
    assert list(data.steps[:3]) == [1, 2, 3]
    assert list(data.extra["lr"][:3]) == [1e-05, 9.938625865312252e-06, 9.756177587652857e-06]
    assert np.isfinite(data.extra["lr"]).all() and not data.warnings
    after = tmp_path / "ds.log"
    after.write_text(
        "steps: 1 loss: 10.8096 iter time (s): 17.413 samples/sec: 0.230\n"
        "[Rank 0] step=1, skipped=0, lr=[1e-05, 2e-05], mom=[(0.9, 0.95), (0.9, 0.95)]\n"
        "steps: 2 loss: 10.7876 iter time (s): 11.239 samples/sec: 0.356\n"
    )
    read = read_log(after)
    assert read.format == "deepspeed" and read.extra["lr"][0] == 1e-05
    assert np.isnan(read.extra["lr"][1])  # step 2 printed no LR


def test_a_text_log_that_fits_no_format_is_one_line_listing_them(tmp_path):
    log = tmp_path / "notes.log"
    log.write_text("epoch one went fine\nthen the second\n")
    out = cli("analyze", str(log))
    assert out.returncode == 2 and "no known log format matched" in out.stderr
    assert "megatron" in out.stderr and "Traceback" not in out.stderr


def test_a_restart_replays_steps_and_a_progress_bar_redraw_does_not(tmp_path):
    """A llm.c main.log whose run restarted from step 2 replays steps 2-3: the first pass is
    kept apart as abandoned. A NeMo-style progress bar drawn again for one step (carriage
    returns) is one row, its last."""
    lines = (LOGS / "llmc/llmc_main_log_gpt2_124M_modded_nanogpt_record.log").read_text()
    head = [ln for ln in lines.splitlines() if ln.startswith("s:")][:8]
    restarted = tmp_path / "main.log"
    restarted.write_text("\n".join(head + [h.replace("trl:", "trl:9") for h in head[3:6]]) + "\n")
    data = read_log(restarted)
    assert data.format == "llmc" and list(data.abandoned["step"]) == [2, 3, 4]
    bar = tmp_path / "nemo.log"
    draws = [
        f"Epoch 0: {i}it [00:0{i}, reduced_train_loss={3 - i / 10:.2f}, global_step={i}.0"
        for i in range(5)
    ]
    again = draws[4].replace("2.60", "2.55") + ", val_loss=2.9"
    bar.write_text("\r".join([*draws, again]) + "\n")
    nemo = read_log(bar)
    assert nemo.format == "nemo" and list(nemo.steps) == [0, 1, 2, 3, 4]
    assert nemo.loss[-1] == pytest.approx(2.55) and not len(nemo.abandoned)
    assert list(nemo.evals["loss"]) == [2.9]


def test_llmc_stdout_of_today_with_its_z_scores_is_read(tmp_path):
    """llm.c's train_gpt2.cu prints `step %4d/%d | loss %7.6f (%+.2fz)| norm %6.4f (%+.2fz)| lr
    ...` now (it printed `train loss` before): lines in that format, written here. The `(+nanz)`
    z-score of the first steps is no NaN loss."""
    log = tmp_path / "train_gpt2cu.out"
    log.write_text(
        "val loss 11.006021\n"
        "step    1/21479 | loss 11.007906 (+nanz)| norm 16.3235 (+nanz)| lr 2.86e-06 | "
        "2734.72 ms | -100.0% bf16 MFU | 167751 tok/s\n"
        "step    2/21479 | loss 10.829729 (+nanz)| norm 15.0011 (+nanz)| lr 5.71e-06 | "
        "2391.52 ms | -100.0% bf16 MFU | 191824 tok/s\n"
        "step    3/21479 | loss 10.543671 (-1.52z)| norm 11.0997 (-0.73z)| lr 8.57e-06 | "
        "2397.11 ms | 41.2% bf16 MFU | 191595 tok/s\n"
    )
    data = read_log(log)
    assert data.format == "llmc" and list(data.steps) == [1, 2, 3]
    assert list(data.loss) == [11.007906, 10.829729, 10.543671]
    assert list(data.extra["grad_norm"]) == [16.3235, 15.0011, 11.0997]
    assert list(data.extra["lr"]) == [2.86e-06, 5.71e-06, 8.57e-06]
    assert list(data.evals["loss"]) == [11.006021] and not data.warnings


def test_megatron_intervals_with_nan_iterations_read_as_nan(tmp_path):
    line = (LOGS / "megatron/megatron_lm_resume_from_14000_srun_prefixed.log").read_text()
    rows = [ln for ln in line.splitlines() if "iteration " in ln and "lm loss" in ln]
    assert len(rows) == 19
    rows[10] = rows[10].replace("number of nan iterations:   0", "number of nan iterations:   3")
    log = tmp_path / "megatron.log"
    log.write_text("\n".join(rows) + "\n")
    data = read_log(log)
    assert np.isnan(data.loss[10]) and np.isfinite(np.delete(data.loss, 10)).all()
    assert [e.kind for e in analyze(data).events if e.severity == "critical"] == ["nonfinite"]


def test_a_modded_nanogpt_log_with_validation_only_is_judged_on_it():
    data = read_log(LOGS / "modded_nanogpt/modded_nanogpt_2025-09-03_FA3_44fc1276_valonly.txt")
    assert data.format == "modded_nanogpt" and list(data.steps) == [0, 125, 250, 1670]
    assert data.loss[-1] == pytest.approx(3.2755)
    assert "no training loss: judging its evaluation loss" in data.warnings[0]


def test_a_damaged_trainer_state_is_one_clear_line(tmp_path):
    whole = (LOGS / "hf_trainer_state/trl_sft_tinyllama_trainer_state.json").read_text()
    cut = tmp_path / "trainer_state.json"
    cut.write_text(whole[: len(whole) // 2])
    out = cli("analyze", str(cut))
    assert out.returncode == 2 and "not a readable trainer_state.json" in out.stderr
    assert "Traceback" not in out.stderr
    folder = tmp_path / "checkpoint-500"
    folder.mkdir()
    (folder / "trainer_state.json").write_text(whole)
    assert read_log(folder).format == "hf_trainer_state"  # a checkpoint folder is read too


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("hf_trainer_state/trl_sft_tinyllama_trainer_state.json", "hf_trainer_state"),
        ("lightning_csv/slm_training_version_0_metrics.csv", "lightning_csv"),
        ("wandb_csv/nanogpt_panel_export_8runs_train_loss_MIN_MAX.csv", "wandb_csv"),
        ("llmc/llmc_main_log_gpt2_124M_modded_nanogpt_record.log", "llmc"),
    ],
)
def test_a_byte_order_mark_changes_nothing(tmp_path, name, fmt):
    """Excel and Windows tools save UTF-8 with a BOM: the same format and rows are read."""
    plain = read_runs(LOGS / name)
    marked = tmp_path / Path(name).name
    marked.write_bytes(b"\xef\xbb\xbf" + (LOGS / name).read_bytes())
    again = read_runs(marked)
    assert [r.format for r in again] == [fmt] * len(plain)
    assert [list(r.steps) for r in again] == [list(r.steps) for r in plain]
    assert [sorted(r.extra) for r in again] == [sorted(r.extra) for r in plain]
    assert not any(r.warnings for r in again)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\ufeff" + "".join(f'{{"step": {i}, "loss": 2.0}}\n' for i in range(5)))
    assert len(read_log(metrics).steps) == 5 and not read_log(metrics).warnings


def test_a_lightning_lr_logged_on_rows_of_its_own_is_read_per_step(tmp_path):
    """LearningRateMonitor writes `lr-AdamW` on rows without the loss."""
    log = tmp_path / "metrics.csv"
    log.write_text(
        "epoch,lr-AdamW,step,train_loss,val_loss\n"
        ",0.001,0,,\n0,,0,2.5,\n0,,1,2.4,\n,0.0005,2,,\n0,,2,2.3,\n0,,2,,2.6\n"
    )
    data = read_log(log)
    assert data.format == "lightning_csv" and list(data.steps) == [0, 1, 2]
    assert list(data.extra["lr"]) == [0.001, 0.001, 0.0005]
    assert list(data.evals["loss"]) == [2.6] and not data.warnings


def test_a_nemo2_log_is_nemo_and_its_evaluation_is_counted_once():
    """NeMo 2 prints `Training epoch 0, iteration N/M | lr: X | global_step: N |
    reduced_train_loss: X | ... | val_loss: X`, the last evaluation's loss repeated on every later
    line (a BioNeMo Evo2 fine-tune's stdout): read as nemo, not as a Megatron `iteration N/M |`
    line; the repeated val_loss is one evaluation, and a checkpoint's name
    (`evo2--val_loss=0.0000-epoch=0-...ckpt`) is none."""
    data = read_log(LOGS / "nemo/nemo2_evo2_finetune_stdout_notebook_export.log")
    assert data.format == "nemo" and list(data.steps) == list(range(10))
    assert list(data.loss[:3]) == [1.371, 1.37, 1.259]
    assert list(data.extra["lr"][4:7]) == [8e-05, 0.0001, 3e-05]
    assert list(data.evals["step"]) == [5] and list(data.evals["loss"]) == [1.264]


def test_a_nemo_checkpoint_name_is_no_training_row_nor_evaluation(tmp_path):
    log = tmp_path / "nemo.log"
    log.write_text(
        "Epoch 0: 10it [reduced_train_loss=3.1, global_step=9.00, val_loss=3.3]\n"
        "saving megatron_gpt--val_loss=2.80-step=9-consumed_samples=80.0.ckpt\n"
        "restored nemo2_sft--reduced_train_loss=0.0801-epoch=3-step=2175-last\n"
        "Epoch 0: 11it [reduced_train_loss=3.0, global_step=10.00, val_loss=3.3]\n"
    )
    data = read_log(log)
    assert list(data.steps) == [9, 10] and list(data.loss) == [3.1, 3.0]
    assert list(data.evals["loss"]) == [3.3]


def test_nemo_redraws_keep_the_fields_a_later_draw_lacks(tmp_path):
    log = tmp_path / "nemo.log"
    log.write_text(
        "Epoch 0: 99it [reduced_train_loss=3.1, global_step=99.0, lr=0.0002, grad_norm=1.5\r"
        "Epoch 0: 99it [reduced_train_loss=3.1, global_step=99.0, val_loss=3.3]\n"
    )
    data = read_log(log)
    assert data.extra["lr"][0] == 0.0002 and data.extra["grad_norm"][0] == 1.5
    assert list(data.evals["loss"]) == [3.3]


def test_column_flags_and_run_names_are_refused_where_they_do_not_apply(tmp_path):
    megatron = LOGS / "megatron/megatron_lm_resume_from_14000_srun_prefixed.log"
    out = cli("analyze", str(megatron), "--column", "nll")
    assert (
        out.returncode == 2 and "reads as a megatron log: --column and --step-column" in out.stderr
    )
    out = cli("analyze", str(megatron), "--run", "foo")
    assert out.returncode == 2 and "holds one run: drop --run" in out.stderr
    stdout = tmp_path / "hf_stdout.log"  # the HF Trainer's printed dicts carry no step
    stdout.write_text("{'loss': 3.2, 'grad_norm': 1.1, 'learning_rate': 5e-05, 'epoch': 0.1}\n")
    out = cli("analyze", str(stdout))
    assert out.returncode == 2 and "no known log format matched" in out.stderr


def test_json_names_the_format_and_report_takes_the_column_flags(tmp_path):
    out = cli(
        "analyze", str(LOGS / "llmc/llmc_main_log_gpt2_124M_modded_nanogpt_record.log"), "--json"
    )
    assert json.loads(out.stdout)["summary"]["format"] == "llmc"
    odd = tmp_path / "odd.csv"
    odd.write_text("it,nll\n" + "".join(f"{i},{3 - i / 1000}\n" for i in range(100)))
    page = tmp_path / "r.html"
    made = cli("report", str(odd), "--column", "nll", "--step-column", "it", "-o", str(page))
    assert made.returncode == 0 and page.stat().st_size > 0


def test_a_megatron_field_that_is_no_number_is_passed_over_not_a_traceback(tmp_path):
    log = tmp_path / "megatron.log"
    log.write_text(
        " iteration 10/ 500000 | learning rate: 1.5E-05 | lm loss: n/a | grad norm: 1.0 |\n"
        " iteration 20/ 500000 | learning rate: 1.5E-05 | lm loss: 9.8E+00 | grad norm: -- |\n"
        " iteration 30/ 500000 | learning rate: 1.5E-05 | lm loss: 9.6E+00 | grad norm: 2.0 |\n"
    )
    data = read_log(log)
    assert list(data.steps) == [20, 30] and list(data.loss) == [9.8, 9.6]
    assert np.isnan(data.extra["grad_norm"][0]) and data.extra["grad_norm"][1] == 2.0
    out = cli("analyze", str(log))
    assert out.returncode == 0 and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("name", "packed_name"),
    [
        ("llmc/llmc_main_log_gpt2_124M_modded_nanogpt_record.log", "main.log.gz"),
        ("lightning_csv/slm_training_version_0_metrics.csv", "metrics.csv.gz"),
        ("wandb_csv/chatterbox_tts_run_history_export_step_runtime.csv", "history.csv.gz"),
        ("hf_trainer_state/trl_sft_tinyllama_trainer_state.json", "trainer_state.json.gz"),
        ("megatron/megatron_lm_resume_from_14000_srun_prefixed.log", "run.log"),  # no .gz
    ],
)
def test_a_gzipped_log_reads_as_the_log_itself(tmp_path, name, packed_name):
    """A gzip-compressed log is found by its first bytes, decompressed as it is read, and its
    format found from the content (and the name without .gz)."""
    plain = read_runs(LOGS / name)
    packed = tmp_path / packed_name
    packed.write_bytes(gzip.compress((LOGS / name).read_bytes()))
    again = read_runs(packed)
    assert [r.format for r in again] == [r.format for r in plain]
    for one, other in zip(again, plain, strict=True):
        assert list(one.steps) == list(other.steps)
        assert np.array_equal(one.loss, other.loss, equal_nan=True)
        assert sorted(one.extra) == sorted(other.extra)
        assert list(one.evals.get("loss", ())) == list(other.evals.get("loss", ()))
        assert one.warnings == other.warnings


def test_a_gzipped_jsonl_with_a_nan_is_judged_and_a_damaged_gzip_is_one_line(tmp_path):
    rows = [{"step": i, "loss": 3.0 - i / 1e5} for i in range(60_000)]
    rows[40_000]["loss"] = float("nan")
    text = "".join(json.dumps(r) + "\n" for r in rows)
    packed = tmp_path / "metrics.jsonl.gz"
    packed.write_bytes(gzip.compress(text.encode()))
    out = cli("analyze", str(packed), "--json")
    assert out.returncode == 1 and json.loads(out.stdout)["summary"]["format"] == "jsonl"
    assert read_log(packed).steps[-1] == 59_999
    whole = gzip.compress(
        (LOGS / "llmc/llmc_main_log_gpt2_124M_modded_nanogpt_record.log").read_bytes()
    )
    short = tmp_path / "main.log.gz"  # cut short within the head the format is found by
    short.write_bytes(whole[: len(whole) // 2])
    cut = tmp_path / "big.jsonl.gz"  # cut short after it: the reading finds it
    big = packed.read_bytes()
    cut.write_bytes(big[: len(big) * 9 // 10])
    corrupt = tmp_path / "corrupt.log.gz"
    corrupt.write_bytes(whole[:-8] + bytes(8))  # its CRC and length zeroed
    for damaged in (short, cut, corrupt):
        out = cli("analyze", str(damaged))
        assert out.returncode == 2 and "damaged gzip file" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    empty = tmp_path / "empty.log.gz"
    empty.write_bytes(gzip.compress(b""))
    with pytest.raises(TrainguardError, match="empty once decompressed"):
        read_log(empty)


def test_a_folder_of_logs_names_them_or_reads_its_one_log(tmp_path):
    """A folder without metrics.jsonl, trainer_state.json, metrics.csv or event files (a Slurm
    job's): its one log among other files is read, and the warning says which; several logs are
    one line that names them and says to pass one; none is one line naming the files found."""
    job = tmp_path / "job"
    job.mkdir()
    megatron = LOGS / "megatron/megatron_lm_resume_from_14000_srun_prefixed.log"
    shutil.copy(megatron, job / "2340717.out")
    (job / "2340717.err").write_text("srun: warning: can't honor --ntasks-per-node set to 4\n")
    (job / "notes.txt").write_text("lr sweep, second try\n")
    data = read_log(job)
    assert data.format == "megatron" and len(data.steps) == 19
    assert "2340717.out" in data.warnings[0] and str(job) in data.warnings[0]
    out = cli("analyze", str(job))
    assert out.returncode in (0, 1) and "2340717.out" in out.stderr
    llmc = LOGS / "llmc/llmc_main_log_gpt2_124M_modded_nanogpt_record.log"
    (job / "main.log.gz").write_bytes(gzip.compress(llmc.read_bytes()))  # a gzipped one counts
    out = cli("analyze", str(job))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert "2 logs (2340717.out, main.log.gz)" in out.stderr and "pass one of them" in out.stderr
    assert read_log(job, format="llmc").format == "llmc"  # the one log of that format
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("rerun with warmup\n")
    with pytest.raises(TrainguardError, match=r"no log in a known format \(found: todo.txt\)"):
        read_log(notes)
