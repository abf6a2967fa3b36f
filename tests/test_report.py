"""`trainguard report`: one self-contained HTML file, checked in headless Chromium (Debian's
`chromium`, which `make test` installs): no console errors, no network, plots drawn, cards."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from test_real_curves import CURVES
from trainguard.demo.scenarios import Fault, run_scenario

EXE = shutil.which("trainguard", path=str(Path(sys.executable).parent))
CHROMIUM = os.environ.get("TRAINGUARD_CHROMIUM", "/usr/bin/chromium")
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
]
LAYOUT_CHECK = """() => {
  const found = [];
  const root = document.documentElement;
  if (root.scrollWidth > window.innerWidth) found.push(`page ${root.scrollWidth} wide`);
  const cards = Array.from(document.querySelectorAll('.incident'));
  const boxes = cards.map(c => c.getBoundingClientRect());
  cards.forEach((card, i) => {
    const box = boxes[i], step = card.dataset.step;
    if (card.scrollWidth > card.clientWidth + 1) found.push(`card ${step} scrolls sideways`);
    boxes.forEach((other, j) => {
      if (j > i && box.left < other.right - 1 && other.left < box.right - 1
          && box.top < other.bottom - 1 && other.top < box.bottom - 1)
        found.push(`cards ${step} and ${cards[j].dataset.step} overlap`);
    });
    const walker = document.createTreeWalker(card, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      const range = document.createRange();
      range.selectNodeContents(node);
      for (const r of range.getClientRects()) {
        if (r.width && (r.left < box.left - 1 || r.right > box.right + 1)) {
          found.push(`card ${step}: text outside: ${node.textContent.slice(0, 40)}`);
          break;
        }
      }
    }
  });
  return found;
}"""
HOSTILE = '<img src=x onerror="window.__xss=1"></script><script>window.__xss=2</script>'
# plotly's pseudo-HTML, and its hovertemplate's syntax: shown as text wherever a figure has it
MARKUP = '<a href="https://example.invalid/x">click</a> <b>b</b> <span style="color:red">r</span>'
MARKUP += " %{x} $y$"
LIVE_MARKUP = """() => Array.from(document.querySelectorAll('.js-plotly-plot *')).filter(
  el => Array.from(el.attributes).some(
    a => a.name !== "data-unformatted" && /example\\.invalid|red|bold/.test(a.value))
).map(el => el.outerHTML.slice(0, 120))"""


def report(*args: str) -> subprocess.CompletedProcess[str]:
    assert EXE
    return subprocess.run(
        [EXE, "report", *args], capture_output=True, text=True, timeout=300, check=False
    )


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).is_file(), (
        f"{CHROMIUM} is missing: `make test` installs Debian's chromium (apt-get install "
        "chromium), or set TRAINGUARD_CHROMIUM"
    )
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


class Page:
    """A report opened in Chromium, with what it logged and requested."""

    def __init__(self, browser, path: Path) -> None:
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", lambda d: (self.errors.append("dialog " + d.message), d.dismiss()))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(path.resolve().as_uri())
        self.page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length")
        self.page.wait_for_timeout(300)

    def check_self_contained_and_drawn(self, plots: int) -> None:
        assert self.errors == []
        assert self.requests == [self.page.url]  # the file itself and nothing else
        assert self.page.locator(".js-plotly-plot").count() == plots
        assert self.page.locator(".js-plotly-plot .scatterlayer .trace").count() >= 3
        shot = Image.open(io.BytesIO(self.page.screenshot(full_page=True))).convert("RGB")
        pixels = np.asarray(shot.resize((shot.width // 4, shot.height // 4))).reshape(-1, 3)
        colours = len(np.unique(pixels, axis=0))
        inked = float(np.mean(pixels.astype(int).sum(axis=1) < 600))
        assert colours > 200 and inked > 0.03, (colours, inked)

    def layout_problems(self) -> list[str]:
        """Cards wider than their column, cards that overlap, text outside its card, and a page
        wider than the window."""
        return self.page.evaluate(LAYOUT_CHECK)

    def figure(self, name: str = "curves") -> dict:
        return self.page.evaluate(f"() => ({{data: fig_{name}.data, layout: fig_{name}.layout}})")

    def cards(self) -> dict[int, str]:
        cards = self.page.locator(".incident")
        return {
            int(cards.nth(i).get_attribute("data-step")): cards.nth(i).inner_text()
            for i in range(cards.count())
        }


def linked_resources(page: str) -> list[str]:
    """Every src or href attribute of the page's tags (script text is not parsed as tags)."""
    found: list[str] = []

    class Tags(HTMLParser):
        def handle_starttag(self, tag, attrs):
            found.extend(f"{tag} {v}" for k, v in attrs if k in ("src", "href") and v)

    Tags().feed(page)
    return found


@pytest.fixture(scope="module")
def guarded_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    run_scenario(Fault(toxic=(150,), log0_at=120), steps=220, run_dir=run_dir)
    return run_dir


def test_a_guarded_run_with_a_nan_and_a_toxic_batch(browser, guarded_run, tmp_path):
    out = report(str(guarded_run), "-o", str(tmp_path / "r.html"))
    assert out.returncode == 0, out.stderr
    assert linked_resources((tmp_path / "r.html").read_text()) == []
    page = Page(browser, tmp_path / "r.html")
    page.check_self_contained_and_drawn(plots=2)  # the curves and the group heat map
    cards = page.cards()
    events = [json.loads(line) for line in (guarded_run / "events.jsonl").open()]
    incidents = {
        e["step"]
        for e in events
        if e["severity"] != "info"
        and e["kind"] not in ("spike_classified", "spike_samples", "nan_origin", "rollback")
        and e["kind"] not in ("lr_reduced", "lint")
    }
    assert set(cards) == incidents and {120, 150} <= incidents
    assert "blocks.0.mlp" in cards[120] and "aten.log" in cards[120] and "skip" in cards[120]
    # the frames are the user's code (here the demo's, and this test's), not trainguard's own
    assert "scenarios.py" in cards[120] and "guard.py" not in cards[120]
    assert "data toxicity" in cards[150] and "recovered" in cards[150]
    assert page.layout_problems() == []
    figure = page.figure()
    (nan_mark,) = [t for t in figure["data"] if t.get("name") == "nonfinite"]
    assert nan_mark["x"] == [120] and nan_mark["y"][0] is not None  # drawn where it happened
    assert [s["x0"] for s in figure["layout"]["shapes"] if s.get("x0") == 120]  # and across
    assert page.page.locator("text=Set-up lint").count() == 1
    assert "max_grad_norm" in page.page.locator("pre").last.inner_text()


def hostile_run(run_dir: Path) -> None:
    """A run directory whose names, messages and samples carry markup."""
    metrics = []
    for step in range(400):
        loss = 3.0 / (1 + step / 50) + 0.5 + (3.0 if step == 200 else 0.0)
        metrics.append(
            {
                "step": step,
                "elapsed_s": step * 0.1,
                "loss": loss,
                "grad_norm": 1.0,
                "lr": 1e-3,
                "loss_scale": 65536.0 if step < 300 else 32768.0,
                "action": "skip" if step == 200 else "step",
                "group_grad_norms": {HOSTILE: 0.5, "blocks.0": 0.25, MARKUP: 0.125},
            }
        )
    metrics[250]["loss"] = "nan"
    # a step later abandoned by a rollback
    metrics.insert(260, {**metrics[259], "loss": 9.0, "action": "rollback"})
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in metrics) + "\n{cut")
    events = [
        {
            "step": 0,
            "kind": "lint",
            "severity": "info",
            "message": HOSTILE,
            "metrics": {"code": "no-warmup", "severity": "warning", "message": HOSTILE, "fix": "x"},
        },
        {
            "step": 200,
            "kind": "loss_spike",
            "severity": "critical",
            "type": "data_toxicity",
            "message": "spike " + HOSTILE,
            "metrics": {"loss": 3.6},
            "action": "skip",
        },
        {
            "step": 200,
            "kind": "spike_samples",
            "severity": "warning",
            "message": "samples",
            "metrics": {"samples": [{"id": HOSTILE, "loss": 9.5, "preview": HOSTILE}]},
            "action": "skip",
        },
        {
            "step": 250,
            "kind": "nonfinite",
            "severity": "critical",
            "message": "the loss is nan",
            "metrics": {},
            "action": "skip",
        },
        {
            "step": 250,
            "kind": "nan_origin",
            "severity": "critical",
            "message": "origin " + HOSTILE,
            "metrics": {"module": HOSTILE, "frames": [HOSTILE]},
            "action": "skip",
        },
        {"step": 201, "kind": "grad_spike", "severity": "warning", "type": MARKUP, "message": "t"},
        {"step": 252, "kind": MARKUP, "severity": "warning", "message": "m " + MARKUP},
        {
            "step": 253,
            "kind": "eval_decline",
            "severity": "warning",
            "message": MARKUP,
            "metrics": {"name": "val " + MARKUP, "value": 2.5},
        },
    ]
    (run_dir / "events.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")
    (run_dir / "config.json").write_text(json.dumps({"max_grad_norm": 1.0, "note": HOSTILE}))
    evals = [{"step": s, "values": {"val " + MARKUP: 2.0 + s / 400}} for s in range(0, 400, 50)]
    (run_dir / "evals.jsonl").write_text("\n".join(json.dumps(e) for e in evals) + "\n")


def test_every_user_string_is_escaped(browser, tmp_path):
    hostile_run(tmp_path)
    out = report(str(tmp_path), "-o", str(tmp_path / "r.html"), "--title", HOSTILE)
    assert out.returncode == 0, out.stderr
    page = Page(browser, tmp_path / "r.html")
    page.check_self_contained_and_drawn(plots=2)
    assert page.page.evaluate("window.__xss") is None
    assert page.page.locator("img").count() == 0
    cards = page.cards()
    assert set(cards) == {200, 250}
    assert HOSTILE in cards[200] and HOSTILE in cards[250]  # shown as text, not run
    assert page.page.locator("h1").inner_text() == HOSTILE
    # four panels: loss, grad norm, LR, loss scale; the abandoned step is drawn apart
    assert page.page.locator("#curves .yaxislayer-above").count() >= 4
    legend = page.page.locator("#curves .legendtext").all_text_contents()
    assert "abandoned by a rollback" in legend
    # plotly's pseudo-HTML in a kind, a type, an evaluation's and a group's name and a message:
    # no link, bold or colour drawn, the markup shown as it was written
    assert page.page.evaluate(LIVE_MARKUP) == []
    assert MARKUP in legend and "val " + MARKUP in legend  # a kind or type; an evaluation
    titles = page.page.locator("#curves [class^=g-y][class$=title]").all_text_contents()
    assert "val " + MARKUP in titles
    assert MARKUP in page.page.locator("#groups .ytick").all_text_contents()
    (kind,) = [i for i, t in enumerate(page.figure()["data"]) if t.get("x") == [252]]
    page.page.evaluate(
        f"() => Plotly.Fx.hover('curves', [{{curveNumber: {kind}, pointNumber: 0}}])"
    )
    hover = page.page.locator("#curves .hoverlayer").text_content() or ""
    assert f"step 252: {MARKUP[:40]}" in hover and "m <a href" in hover and "%{x} $y$" in hover
    assert page.page.evaluate(LIVE_MARKUP) == []


def test_a_bare_log_is_judged_and_reported(browser, tmp_path):
    out = report(
        str(CURVES / "megatron-mixtral8x7b-release-v080.csv"), "-o", str(tmp_path / "m.html")
    )
    assert out.returncode == 0, out.stderr
    page = Page(browser, tmp_path / "m.html")
    page.check_self_contained_and_drawn(plots=1)
    assert set(page.cards()) == {2675, 3645, 3775, 4600, 4700}  # the spikes of SOURCES.md
    assert "judged offline" in page.page.locator("table").first.inner_text()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["/nonexistent/run"], "no such file"),
        (["{curve}", "-o", "/nonexistent/dir/r.html"], "does not exist"),
        (["{tmp}"], "without metrics.jsonl"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, fragment):
    curve = str(CURVES / "rig-500m-bs128-s1337.csv")
    out = report(*[a.format(curve=curve, tmp=tmp_path) for a in args])
    assert out.returncode == 2 and fragment in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_a_run_with_hundreds_of_incidents_shows_the_first_cards_and_says_how_many_more(tmp_path):
    from trainguard.analysis.run import RunRecord
    from trainguard.sinks.html_report import MAX_CARDS, write_report

    steps = np.arange(20_000)
    loss = 2.0 + 0.01 * np.sin(steps)
    events = [
        {"step": int(s), "kind": "loss_spike", "severity": "warning", "message": f"spike {s}"}
        for s in range(100, 20_000, 80)
    ]
    record = RunRecord(tmp_path, steps, {"loss": loss}, events=events)
    page = write_report(record, tmp_path / "r.html").read_text()
    assert page.count('class="incident"') == MAX_CARDS
    assert f"and {len(events) - MAX_CARDS} more incidents" in page


def typed_run(run_dir: Path) -> None:
    """A guarded run's files: a spike first typed data toxicity and revised as gradient
    explosion, with a grad spike at its step, the step replayed after a rollback; a NaN loss at
    step 200; a constant LR of 3e-3 and grad norms between 0.3 and 8."""
    metrics = [
        {
            "step": step,
            "loss": 2.0 + (3.0 if step == 100 else 0.0),
            "grad_norm": 0.3 + 7.7 * (step % 7 == 0),
            "lr": 3e-3,
            "action": "step",
        }
        for step in range(300)
    ]
    metrics[200]["loss"] = "nan"
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in metrics) + "\n")

    def event(step, kind, severity, message, action, metrics=None, type_=None):
        return {
            "step": step,
            "kind": kind,
            "severity": severity,
            "type": type_,
            "message": message,
            "metrics": metrics or {},
            "action": action,
        }

    spike = event(
        100,
        "loss_spike",
        "critical",
        "loss 5 jumped over its level 2",
        "skip",
        {"loss": 5.0},
        "data_toxicity",
    )
    grad = event(
        100,
        "grad_spike",
        "warning",
        "gradient norm 8 is 20x its median",
        "skip",
        {"grad_norm": 8.0},
    )
    revised = event(
        105,
        "spike_classified",
        "info",
        "loss spike at step 100 revised from data toxicity as gradient explosion",
        "rollback",
        {"spike_step": 100, "previous_type": "data_toxicity"},
        "gradient_explosion",
    )
    nan = event(200, "nonfinite", "critical", "the loss is nan", "skip")
    jump = event(
        103,
        "weight_jump",
        "warning",
        "the weights of layer group head moved x998 in one step",
        "step",
    )
    events = [spike, grad, jump, revised, spike, grad, revised, nan]  # the steps trained twice
    (run_dir / "events.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")


def test_markers_and_cards_follow_the_final_type_on_the_right_panel(browser, tmp_path):
    typed_run(tmp_path)
    out = report(str(tmp_path), "-o", str(tmp_path / "r.html"))
    assert out.returncode == 0, out.stderr
    page = Page(browser, tmp_path / "r.html")
    assert page.layout_problems() == []
    figure = page.figure()
    traces = {t.get("name"): t for t in figure["data"]}
    assert traces["gradient explosion"]["x"] == [100] and "data toxicity" not in traces
    assert traces["grad spike"]["yaxis"] == "y2" and traces["grad spike"]["y"] == [8.0]
    assert traces["nonfinite"]["x"] == [200] and traces["nonfinite"]["y"] == [2.0]
    low, high = figure["layout"]["yaxis3"]["range"]  # the constant LR, inside its axis
    assert low < 3e-3 < high and high - low < 1e-2
    ticks = page.page.locator("#curves g.y2tick text").all_text_contents()
    assert "0.5" in ticks and len(ticks) == len(set(ticks))  # 0.5 written out, not "5"
    cards = page.page.locator(".incident")
    assert cards.count() == 2  # one card an incident: the spikes and the jump 3 steps later
    first = cards.nth(0)
    assert "loss spike at steps 100..103" in first.inner_text()
    assert "weight jump at 103" in first.inner_text()
    assert "gradient explosion" in first.inner_text() and "#ff7f0e" in (
        first.get_attribute("style") or ""
    )
    assert "2 times" in first.inner_text() and "grad spike" in first.inner_text()
    assert first.inner_text().count("revised from data toxicity") == 1


def test_a_native_log_report_draws_its_evaluations_and_says_what_it_cannot_show(browser, tmp_path):
    log = (
        Path(__file__).parent
        / "data/native_logs/llmc/llmc_main_log_gpt2_124M_modded_nanogpt_record.log"
    )
    out = report(str(log), "-o", str(tmp_path / "r.html"))
    assert out.returncode == 0, out.stderr
    page = Page(browser, tmp_path / "r.html")
    figure = page.figure()
    (evals,) = [t for t in figure["data"] if t.get("name") == "val loss"]  # its own panel
    assert len(evals["x"]) == 3
    assert not [a for a in figure["layout"].get("annotations", []) if "clip" in a["text"]]
    text = page.page.locator("body").inner_text()
    assert "Not run: a log holds no model" in text and "judged this log with" in text


def test_an_incident_outcome_in_a_sparse_log_is_read_at_the_logged_steps(tmp_path):
    from trainguard.analysis.run import RunRecord
    from trainguard.sinks.html_report import write_report

    steps = np.arange(0, 10_000, 100)
    loss = np.full(len(steps), 2.0)
    loss[10] = 9.0
    events = [{"step": 1000, "kind": "loss_spike", "severity": "warning", "message": "spike"}]
    record = RunRecord(tmp_path, steps, {"loss": loss}, events=events, judged=True)
    page = write_report(record, tmp_path / "r.html").read_text()
    assert "recovered: loss 2 from step 1100 on against 2 before" in page
