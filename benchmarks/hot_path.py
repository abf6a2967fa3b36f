"""The lagged hot path against the synchronous one on the CPU (whose fused AdamW honours
`found_inf`): the demo's model families trained through every planted fault of the demo, once
with `hot_path: sync` and once with `hot_path: lagged`, compared action by action and weight by
weight.

The faults are the demo's (`trainguard.demo.scenarios.FAULTS`), planted by data position or by
*attempt*: a `guard.step` call the lagged path does not drop (its rollback drops the call that
judged it, whose step was never made), so both paths meet each fault at the same step. The
tests tune on an MLP regression (`tests/test_hot_path.py`); these model families and faults are
the held-out half. Reported per run: the non-plain actions (step, action) of each path, whether
they are equal, whether the final weights are equal bit for bit, and the action counts.

Run: python benchmarks/hot_path.py [--families TinyGPT,RecurrentLM] [--faults all] [--steps 400]
     [--jobs 2] [--out results.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

import trainguard as tg
from trainguard.demo import scenarios as sc


def run(family: str, fault_name: str, hot_path: str, steps: int) -> dict[str, Any]:
    """One guarded run of `family` through the demo's `fault_name` on `hot_path`."""
    torch.set_num_threads(1)
    fault = sc.FAULTS[fault_name]
    data = sc.corpus()
    batches = sc.planted(list(data.batches(16, 32, steps + 4000, seed=1)), fault, data)
    torch.manual_seed(0)
    model = sc.FAMILIES[family]()
    opt = torch.optim.AdamW(model.parameters(), lr=sc.LR, fused=True)
    config = tg.GuardConfig(console=False, hot_path=hot_path)
    guard = tg.Guard(model, opt, config=config)
    original = opt.step
    log0 = sc.LogZero(sc.fault_module(model))
    actions: list[tuple[int, str]] = []
    attempt, halted, started = 0, None, time.perf_counter()
    try:
        for batch in guard.batches(batches):
            if guard.global_step >= steps:
                break
            burst = attempt in fault.blowup
            opt.step = (
                functools.partial(sc.scaled_step, opt, original, 100.0) if burst else original
            )  # type: ignore[method-assign]
            log0.armed = attempt == fault.log0_at
            if attempt == fault.corrupt_at:
                with torch.no_grad():
                    model.head.weight.mul_(1e3)
            if attempt == fault.moments_lost_at:
                for state in opt.state.values():
                    state["exp_avg_sq"].zero_()

            def forward(batch: sc.Batch = batch, attempt: int = attempt) -> torch.Tensor:
                logits = model(batch.x, batch.input_scale)
                if fault.persistent_from is not None and attempt >= fault.persistent_from:
                    noise = 0.05 * (attempt - fault.persistent_from)
                    logits = logits + noise * torch.randn_like(logits)
                return model.loss(logits, batch.y)

            loss = forward()
            loss.backward()  # type: ignore[no-untyped-call]
            if attempt in fault.overflow:
                with torch.no_grad():
                    model.head.weight.grad.fill_(float("inf"))  # type: ignore[union-attr]
            decision = guard.step(loss, batch_ids=batch.ids, replay=forward)
            if decision.action != "step":
                actions.append((decision.step, decision.action))
            if not (hot_path == "lagged" and decision.action == "rollback"):
                attempt += 1
            opt.zero_grad(set_to_none=True)
        last = guard.judge_pending()
        if last is not None and last.action != "step":
            actions.append((last.step, last.action))
    except tg.TrainingHalted as exc:
        halted = exc.decision.step
    finally:
        opt.step = original  # type: ignore[method-assign]
        log0.remove()
        guard.close()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {
        "family": family,
        "fault": fault_name,
        "hot_path": hot_path,
        "actions": actions,
        "halted_at": halted,
        "counts": dict(guard.action_counts),
        "weights": weights.tolist(),
        "seconds": time.perf_counter() - started,
    }


def compare(sync: dict[str, Any], lagged: dict[str, Any]) -> dict[str, Any]:
    return {
        "family": sync["family"],
        "fault": sync["fault"],
        "same_actions": sync["actions"] == lagged["actions"],
        "same_weights": sync["weights"] == lagged["weights"],
        "same_counts": sync["counts"] == lagged["counts"],
        "actions": sync["actions"],
        "lagged_actions": lagged["actions"],
        "halted_at": [sync["halted_at"], lagged["halted_at"]],
        "counts": sync["counts"],
    }


def report(rows: list[dict[str, Any]], command: str) -> str:
    same = sum(r["same_actions"] and r["same_weights"] and r["same_counts"] for r in rows)
    halted = sum(r["halted_at"][0] is not None for r in rows)
    acted = sum(bool(r["actions"]) for r in rows)
    lines = [
        f"Command: `{command}`",
        "",
        f"{same} of {len(rows)} runs alike on both paths (every action, the action counts and "
        f"the final weights bit for bit); {acted} of them acted on by the guard, {halted} "
        "halted.",
        "",
        "| family | fault | actions (step: action), sync | alike | weights equal |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        shown = ", ".join(f"{s}: {a}" for s, a in r["actions"]) or "none"
        if len(shown) > 120:
            shown = shown[:117] + "..."
        lines.append(
            f"| {r['family']} | {r['fault']} | {shown} | "
            f"{'yes' if r['same_actions'] and r['same_counts'] else 'NO'} | "
            f"{'yes' if r['same_weights'] else weights_note(r)} |"
        )
    return "\n".join(lines)


def weights_note(row: dict[str, Any]) -> str:
    """Why the weights differ: after a halt the lagged path has made the halted step's update
    (documented: the halt is judged a call later); anything else is a defect."""
    sync_halt, lagged_halt = row["halted_at"]
    if sync_halt is not None and sync_halt == lagged_halt:
        return f"no: the halted step {sync_halt}'s update, made before its halt was judged"
    return "NO"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="TinyGPT,RecurrentLM")
    parser.add_argument("--faults", default="all")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--rows", default=None, help="report rows an earlier --out saved")
    args = parser.parse_args()
    families = args.families.split(",")
    faults = list(sc.FAULTS) if args.faults == "all" else args.faults.split(",")
    jobs = [(f, x, p, args.steps) for f in families for x in faults for p in ("sync", "lagged")]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        done = list(pool.map(run, *zip(*jobs, strict=True)))
    by_key = {(d["family"], d["fault"], d["hot_path"]): d for d in done}
    rows = [
        compare(by_key[(f, x, "sync")], by_key[(f, x, "lagged")]) for f in families for x in faults
    ]
    if args.rows:
        with open(args.rows) as fh:
            print(report(json.load(fh), "python " + " ".join(sys.argv)))
        return
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    print(report(rows, "python " + " ".join(sys.argv)))


if __name__ == "__main__":
    main()
