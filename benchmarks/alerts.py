"""Training speed with an alert webhook that answers 500 or hangs, against no webhook.

The benchmark GPT trains on the CPU with a NaN planted every 10 steps (each one an alert, with
`interval_s: 0` so none is held back): three guards take turns step by step, one with no
webhook, one whose webhook answers HTTP 500 to everything, one whose webhook never answers
(each send times out after 2 s). Delivery runs on a background thread, so the ratio should stay
within 1%.

Run: python benchmarks/alerts.py [--steps 60] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

import trainguard as tg
from _common import gpt, write_section
from trainguard.demo import MarkovCorpus


def serve(status: int | None) -> ThreadingHTTPServer:
    """A local webhook that answers `status`, or never answers when None."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if status is None:
                time.sleep(3600)
            self.send_response(status or 200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    corpus = MarkovCorpus(vocab_size=256, length=200_000)
    batches = list(corpus.batches(8, 128, args.steps + 5, seed=1))
    failing, hanging = serve(500), serve(None)
    variants = {}
    for name, server in (
        ("no webhook", None),
        ("webhook answers 500", failing),
        ("webhook hangs", hanging),
    ):
        model, opt = gpt()
        alerts: dict = {"interval_s": 0, "retries": 2, "backoff_s": 0.5}
        if server is not None:
            url = f"http://127.0.0.1:{server.server_port}/hook"
            alerts["webhook"] = {"url": url, "timeout_s": 2.0}
        config = tg.GuardConfig.from_dict(
            {"console": False, "alerts": alerts, "recovery": {"checkpoint_every": 0}}
        )
        variants[name] = (model, opt, tg.Guard(model, opt, config=config), [])
    for i, b in enumerate(batches):
        names = list(variants)
        for name in names[i % 3 :] + names[: i % 3]:
            model, opt, guard, times = variants[name]
            start = time.perf_counter()
            loss = model.loss(model(b.x), b.y)
            if i % 10 == 9:
                loss = loss * float("nan")
            loss.backward()
            guard.step(loss)
            opt.zero_grad(set_to_none=True)
            if i >= 5:
                times.append(time.perf_counter() - start)
    base = statistics.median(variants["no webhook"][3])
    rows = ["| guard | ms / step | ratio | alerts sent / failed |", "|---|---:|---:|---:|"]
    for name, (_, _, guard, times) in variants.items():
        sink = next((s for s in guard.sinks if hasattr(s, "deliveries")), None)
        delivery = sink.deliveries.get("webhook") if sink is not None else None  # type: ignore[attr-defined]
        counts = f"{delivery.sent} / {delivery.failed}" if delivery else "-"
        med = statistics.median(times)
        rows.append(f"| {name} | {med * 1000:.1f} | {med / base:.3f} | {counts} |")
    for _, _, guard, _ in variants.values():
        guard.close()
    failing.shutdown()
    body = "\n".join(
        [
            f"The benchmark GPT on the CPU, {args.steps} timed steps per guard, interleaved; a "
            "NaN every 10 steps, each an alert. Median step time:",
            "",
            *rows,
            "",
            "Sends run on a background thread with a bounded queue: a dead or hanging service "
            "costs the training loop nothing it waits for.",
        ]
    )
    print(body)
    if not args.no_write:
        write_section("alerts", "Alert delivery overhead", body, "python benchmarks/alerts.py")


if __name__ == "__main__":
    main()
