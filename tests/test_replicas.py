"""Replica agreement: the fingerprint, the detector, the policy's answer, and DDP runs on gloo
where one rank's weights are nudged by 1e-6 (3 ranks: found and given a good copy; 2 ranks: a
halt with the diagnosis)."""

from __future__ import annotations

import socket

import pytest
import torch
from torch import nn

import trainguard as tg
from test_distributed import events, launch
from trainguard.analysis.run import load_run
from trainguard.detectors import DetectorSuite, MetricPoint
from trainguard.detectors.replicas import ReplicaDivergenceDetector
from trainguard.distributed import RankContext
from trainguard.distributed import replicas as replicas_module
from trainguard.distributed.replicas import ReplicaFingerprint
from trainguard.events import EventKind
from trainguard.policy import StepPolicy
from trainguard.sinks.html_report import write_report


def _fingerprint(model: nn.Module) -> ReplicaFingerprint:
    context = RankContext(rank=0, world_size=1, hosts=["h"], device=torch.device("cpu"))
    return ReplicaFingerprint(model, context, tg.GuardConfig().group_patterns, every=10)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


@pytest.mark.parametrize("chunk", [replicas_module.CHUNK, 2 * 16])  # one chunk a tensor, or many
def test_the_fingerprint_sees_a_1e_minus_6_nudge_and_a_swap_in_the_group_they_hit(
    monkeypatch, chunk
):
    monkeypatch.setattr(replicas_module, "CHUNK", chunk)
    monkeypatch.setattr(replicas_module, "WIDTH", 16 if chunk < 100 else replicas_module.WIDTH)
    model = _model()
    fingerprint = _fingerprint(model)
    assert fingerprint.groups.group_names == ["0", "2"]
    clean = fingerprint.local()
    assert clean.dtype == torch.int64 and clean.shape == (2, 2)
    assert clean.tolist() == [_by_hand(model[0]), _by_hand(model[2])]  # exact, in any chunks
    assert torch.equal(_fingerprint(_model()).local(), clean)  # equal weights, equal bits
    with torch.no_grad():
        model[0].weight[40, 7] += 1e-6
    nudged = fingerprint.local()
    assert not torch.equal(nudged[0], clean[0]) and torch.equal(nudged[1], clean[1])
    with torch.no_grad():
        model[0].weight[40, 7] -= 1e-6
        w = model[2].weight.view(-1)  # a swap keeps the sum: the position ramp sees it
        w[3], w[50] = w[50].clone(), w[3].clone()
    swapped = fingerprint.local()
    assert swapped[1, 0] == clean[1, 0]  # the same values: the same plain sum
    assert swapped[1, 1] != clean[1, 1] and torch.equal(swapped[0], clean[0])
    with torch.no_grad():
        w[3], w[50] = w[50].clone(), w[3].clone()
        model[0].bias.view(torch.int32)[9] ^= 1  # the lowest bit of one float
    flipped = fingerprint.local()
    assert not torch.equal(flipped[0], clean[0]) and torch.equal(flipped[1], clean[1])
    assert fingerprint.due(10) and fingerprint.due(20) and not fingerprint.due(0)
    assert not fingerprint.due(15)


def _by_hand(layer: nn.Module) -> list[int]:
    """A layer group's fingerprint in Python integers: its parameters' bits as 32-bit words,
    their sum and their sum weighted by position (from 1), modulo the prime, added up."""
    total = weighted = 0
    for p in layer.parameters():
        words = p.detach().reshape(-1).view(torch.int32).tolist()
        total += sum(words)
        weighted += sum((i + 1) * w for i, w in enumerate(words))
    return [total % replicas_module.PRIME, weighted % replicas_module.PRIME]


def _point(step: int, classes: dict[str, list[int]] | None) -> MetricPoint:
    return MetricPoint(step=step, loss=1.0, replica_classes=classes)


def test_the_detector_names_the_ranks_outside_the_majority_and_the_last_agreement():
    detector = ReplicaDivergenceDetector()
    assert detector.update(_point(99, None)) == []
    assert detector.update(_point(100, {})) == [] and detector.last_agreed == 100
    (event,) = detector.update(_point(200, {"blocks.3": [0, 0, 1, 0], "head": [0, 1, 0, 0]}))
    assert event.kind == EventKind.REPLICA_DIVERGENCE and event.severity == "critical"
    assert event.metrics["ranks"] == [1, 2] and event.metrics["source"] == 0
    assert event.metrics["groups"] == {"1": ["head"], "2": ["blocks.3"]}
    assert event.metrics["last_agreed_step"] == 100 and event.rank == 1
    assert "rank 1 in layer group head, rank 2 in layer group blocks.3" in event.message
    # rank 0 itself diverged: the lowest rank that agrees everywhere is the source
    (event,) = detector.update(_point(300, {"head": [1, 0, 0]}))
    assert event.metrics["ranks"] == [0] and event.metrics["source"] == 1
    assert detector.last_agreed == 100  # a disagreement is no agreement
    restored = ReplicaDivergenceDetector()
    restored.load_state_dict(detector.state_dict())
    assert restored.last_agreed == 100


def test_with_no_majority_or_no_rank_agreeing_everywhere_there_is_no_source():
    detector = ReplicaDivergenceDetector()
    (two,) = detector.update(_point(10, {"0": [0, 1]}))
    assert two.metrics["source"] is None and two.metrics["ranks"] == [0, 1]
    assert two.metrics["disputed_groups"] == ["0"] and "no majority" in two.message
    assert "no earlier check" in two.message
    (split,) = detector.update(_point(20, {"a": [0, 1, 0], "b": [1, 0, 0], "c": [0, 0, 1]}))
    assert split.metrics["ranks"] == [0, 1, 2] and split.metrics["source"] is None
    assert "no rank agrees with the majority in every group" in split.message


def _decide(classes: dict[str, list[int]], config: tg.GuardConfig | None = None) -> tg.Decision:
    cfg = config or tg.GuardConfig()
    suite = DetectorSuite(cfg)
    policy = StepPolicy(cfg.policy, cfg.recovery)
    suite.update(_point(100, {}))
    point = _point(200, classes)
    return policy.decide(point, suite.update(point), can_roll_back=True)


def test_the_policy_gives_a_majority_copy_or_halts_with_the_diagnosis():
    decision = _decide({"0": [0, 0, 1]})
    assert decision.action == "skip" and decision.resync_from == 0
    assert decision.resync_ranks == [2] and decision.agreed_step == 100
    halted = _decide({"0": [0, 1]})
    assert halted.action == "halt" and halted.resync_from is None
    assert "at or before step 100" in halted.reason and "no majority" in halted.reason
    off = tg.GuardConfig(recovery={"enabled": False})
    assert _decide({"0": [0, 0, 1]}, off).action == "halt"
    cfg = tg.GuardConfig()
    suite, policy = DetectorSuite(cfg), StepPolicy(cfg.policy, cfg.recovery)
    first, again = _point(200, {"0": [0, 0, 1]}), _point(201, {"0": [0, 0, 1]})
    assert policy.decide(first, suite.update(first)).resync_from == 0
    repeat = policy.decide(again, suite.update(again))  # the check right after the copy
    assert repeat.action == "halt" and "differ again right after" in repeat.reason
    strict = tg.GuardConfig(policy={"halt_on": ["replica_divergence"]})
    assert _decide({"0": [0, 0, 1]}, strict).action == "halt"
    assert not any(
        isinstance(d, ReplicaDivergenceDetector)
        for d in DetectorSuite(tg.GuardConfig(replicas={"every": 0})).detectors
    )


def test_a_rank_nudged_by_1e_minus_6_is_found_within_one_interval_and_given_a_good_copy(
    tmp_path,
):
    results = launch("replicas_three", 3, tmp_path)
    for r in results:
        assert r["halted"] is None and len(r["actions"]) == 30  # training went on to the end
        assert [a for a in r["actions"] if a[1] != "step"] == [[15, "skip"], [20, "skip"]]
        assert r["digest"] == results[0]["digest"]  # weights and Adam state bit-identical
        # 5 checks, a gather at 15 and 20 where they differed, a check after each copy
        assert r["checks"] == 9
    found = [e for e in events(tmp_path) if e["kind"].startswith("replica")]
    assert [(e["step"], e["kind"]) for e in found] == [
        (15, "replica_divergence"),
        (15, "replica_resync"),
        (20, "replica_divergence"),
        (20, "replica_resync"),
    ]  # each found at the next check; the checks at 5, 10, 16, 21 and 25 agreed
    weight, copy, state, second_copy = found
    # rank 2's weight, nudged after step 12
    assert weight["rank"] == 2 and weight["metrics"]["groups"] == {"2": ["module.0"]}
    assert weight["metrics"]["last_agreed_step"] == 10 and weight["action"] == "skip"
    assert weight["metrics"]["host"] == socket.gethostname()
    assert copy["rank"] == 2 and copy["metrics"]["source"] == 0
    assert copy["metrics"]["tensors"] == 16  # 4 parameters and Adam's 3 tensors each
    assert copy["metrics"]["dropped_snapshots"] == [12]
    # rank 1's Adam moment, nudged after step 17, moved its weights at step 18; the check right
    # after the first copy (16) is the last agreement; the copy includes Adam's state, or rank
    # 1 would drift again and the digests would differ
    assert state["rank"] == 1 and state["metrics"]["last_agreed_step"] == 16
    assert second_copy["metrics"]["source"] == 0 and second_copy["metrics"]["ranks"] == [1]
    assert second_copy["metrics"]["dropped_snapshots"] == [17]  # taken after the copy at 15
    page = write_report(load_run(tmp_path), tmp_path / "report.html").read_text()
    card = page[page.index('data-kind="replica_divergence"') :]
    assert "gave rank 2 a copy of rank 0" in card[: card.index("</div>")]  # on its card


def test_two_ranks_that_disagree_halt_with_the_diagnosis(tmp_path):
    results = launch("replicas_two", 2, tmp_path)
    for r in results:
        assert r["halted"] is not None and len(r["actions"]) == 10  # steps 0-9, halted at 10
        assert "no majority" in r["halted"] and "at or before step 5" in r["halted"]
        assert "layer group module.0" in r["halted"]
    assert results[0]["digest"] != results[1]["digest"]  # nothing was copied
    found = [e for e in events(tmp_path) if e["kind"] in ("replica_divergence", "halt")]
    assert [(e["step"], e["kind"]) for e in found] == [
        (10, "replica_divergence"),
        (10, "halt"),
    ]
    assert found[0]["metrics"]["ranks"] == [0, 1] and found[0]["metrics"]["source"] is None


def test_a_resync_broadcasts_in_buckets_of_one_dtype_and_bounded_size(monkeypatch):
    from trainguard.actions import replicas as resync_module

    monkeypatch.setattr(resync_module, "BUCKET_BYTES", 100)
    tensors = [torch.zeros(10), torch.zeros(3, dtype=torch.int64), torch.zeros(20), torch.zeros(5)]
    buckets = list(resync_module._buckets(tensors))
    shapes = [[(t.dtype, t.numel()) for t in b] for b in buckets]
    assert shapes == [  # 40 bytes; 80 more would make 120: a new bucket, which 20 fills to 100
        [(torch.float32, 10)],
        [(torch.float32, 20), (torch.float32, 5)],
        [(torch.int64, 3)],  # another dtype, another bucket
    ]
