"""The evaluation corpus (data/evals): real trainer_state.json files, their sources, labels and
halves, read by trainguard's log reader; and the scoring of benchmarks/eval_corpus.py."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import eval_corpus as ec
import trust
from trainguard.analysis import read_log


@pytest.fixture(scope="module")
def corpus() -> list[ec.CorpusFile]:
    return ec.load_corpus()


def test_the_corpus_holds_real_files_from_many_repositories(corpus):
    assert len(corpus) >= 30
    assert len({f.source.repo for f in corpus}) >= 20
    for f in corpus:
        assert re.fullmatch(r"[0-9a-f]{40}", f.source.commit), f.name
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", f.source.repo), f.name
        assert f.source.path and f.source.license, f.name
        assert f.name.startswith(f.source.repo.replace("/", "-", 1) + "-"), f.name
        assert f.label["source"] == f"{f.source.repo}@{f.source.commit}:{f.source.path}"


def test_every_file_has_a_label_of_the_documented_shape(corpus):
    for f in corpus:
        label = f.label
        for key in ec.SPAN_KEYS:
            assert all(len(s) == 2 and s[0] <= s[1] for s in label[key]), (f.name, key)
        assert bool(label["decline"]) == bool(label["decline_metrics"]), f.name
        assert label["healthy"] == (not any(label[k] for k in ec.SPAN_KEYS)), f.name
        names = ec.eval_points(f.history)
        assert all(m in names for m in label["decline_metrics"]), f.name


def test_halves_are_the_trust_split_and_both_hold_declines_and_healthy_runs(corpus):
    for f in corpus:
        assert f.half == f.label["half"] == trust.file_half(f.name) == trust.file_half(f.name)
    for half in ec.HALVES:
        files = [f for f in corpus if f.half == half]
        assert any(f.label["decline"] for f in files), half
        assert any(f.label["healthy"] for f in files), half


def test_labels_are_the_rules_draft_unless_an_override_says_why(corpus):
    for f in corpus:
        differs = ec.label_differences(f)
        if "override" in f.label:
            assert differs, f"{f.name}: an override where the label is the draft"
        else:
            assert not differs, f"{f.name} departs from the rule without an override: {differs}"


def test_the_reader_finds_the_evaluations_of_every_file(corpus):
    for f in corpus:
        data = read_log(f.path)
        assert data.format == "hf_trainer_state", f.name
        assert len(data.steps) >= 3, f.name
        named = data.named_evaluations()
        assert named, f"{f.name}: the reader found no evaluation"
        for name, (steps, values) in named.items():
            assert len(steps) == len(values) >= 3, (f.name, name)
            logged = dict(ec.eval_points(f.history)[name])
            assert [logged[float(s)] for s in steps] == pytest.approx(values), (f.name, name)
        if "eval_loss" in ec.eval_points(f.history):
            assert len(data.evals["step"]) == len(ec.eval_points(f.history)["eval_loss"])


def test_load_corpus_refuses_an_unlisted_file_and_a_damaged_one(tmp_path, corpus):
    for f in corpus[:2]:
        shutil.copy(f.path, tmp_path / f.name)
    for meta in ("SOURCES.md", "labels.json"):
        shutil.copy(ec.CORPUS / meta, tmp_path / meta)
    labels = json.loads((tmp_path / "labels.json").read_text())
    labels = {k: v for k, v in labels.items() if k in {f.name for f in corpus[:2]}}
    (tmp_path / "labels.json").write_text(json.dumps(labels))
    sources = ec.read_sources(tmp_path / "SOURCES.md")
    assert {f.name for f in corpus[:2]} <= set(sources)
    text = (tmp_path / "SOURCES.md").read_text()
    kept = [s for s in text.split("\n### ")[1:] if s.split("\n", 1)[0] in labels]
    (tmp_path / "SOURCES.md").write_text("# sources\n\n### " + "\n### ".join(kept))
    assert len(ec.load_corpus(tmp_path)) == 2
    (tmp_path / "extra-run.json").write_text('{"log_history": []}')
    with pytest.raises(ValueError, match=r"extra-run\.json"):
        ec.load_corpus(tmp_path)
    (tmp_path / "extra-run.json").unlink()
    (tmp_path / corpus[0].name).write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        ec.load_corpus(tmp_path)


def test_scoring_counts_catches_lag_false_and_borderline_firings(corpus):
    f = next(f for f in corpus if f.name == "fabiom91-ConvNeXt_AI_Competition_Platform-model.json")
    ((a, b),) = f.label["decline"]
    after = [s for s in f.eval_steps if s > a]
    firings = [(after[1], "eval_loss"), (100, "eval_accuracy"), (after[0], "eval_loss")]
    score = ec.score_file(f, firings, {"eval_accuracy"})
    assert score.caught == [([a, b], after[0] - a, 1)]
    assert score.false == [(100, "eval_accuracy")] and not score.borderline
    assert score.unread == ["eval_loss"]  # labelled declining, not among those read
    assert ec.score_file(f, [(a - 1, "eval_loss")]).caught == [None]
    g = next(g for g in corpus if g.name == "P-Zande-nlp-team-4-model.json")
    scored = ec.score_file(g, [(4000, "eval_loss"), (1000, "eval_loss")])
    assert scored.borderline == [(4000, "eval_loss")] and scored.false == [(1000, "eval_loss")]
    summary = ec.half_summary([score, scored])
    assert summary["decline_spans"] == 1 and summary["caught"] == 1
    assert summary["false_warnings"] == 2 and summary["borderline_firings"] == 1
    assert summary["missed_unread"] == 0  # the span with an unread evaluation was caught
