"""The docs stay true and navigable: the configuration reference matches `GuardConfig`, the
README is short and its quick start runs, and every relative link leads to a file."""

from __future__ import annotations

import re
from pathlib import Path

from trainguard.config_reference import REGENERATE, config_reference, missing_descriptions

ROOT = Path(__file__).resolve().parent.parent


def test_configuration_reference_is_up_to_date():
    written = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert written == config_reference(), (
        f"docs/configuration.md is out of date with GuardConfig; regenerate it: {REGENERATE}"
    )


def test_every_setting_has_a_description():
    assert missing_descriptions() == [], "add a one-sentence description= to these fields"


def test_reference_has_a_table_per_section_in_order():
    text = config_reference()
    titles = [line[3:] for line in text.splitlines() if line.startswith("## ")]
    assert titles[:4] == ["Top level", "loss_spike", "grad_spike", "grad_explosion"]
    assert titles[-3:] == ["alerts.rules[]", "alerts.webhook", "alerts.email"]
    assert (
        "| `z_threshold` | `float` | `10.0` | Noise standard deviations over the level. |" in text
    )
    assert "| `max_grad_norm` | `float \\| None` | `1.0` |" in text


README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").rglob("*.md")), ROOT / "benchmarks" / "README.md"]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _links(path: Path) -> list[str]:
    """The link targets of a Markdown file, outside code blocks and code spans."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub makes of a Markdown file's headings."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    heads = re.findall(r"^#+\s+(.*?)\s*$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower().replace("`", "")).replace(" ", "-") for h in heads}


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 200, f"README.md has {lines} lines; move reference material into docs/guide/"


def test_every_relative_link_points_to_an_existing_file():
    broken = []
    for doc in DOCS:
        for target in _links(doc):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            where = f"{doc.relative_to(ROOT)} -> {target}"
            if not dest.exists():
                broken.append(where)
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_quick_start_runs(tmp_path, monkeypatch):
    text = README.read_text(encoding="utf-8")
    quick = text[text.index("## Quick start") :]
    start = quick.index("```python\n") + len("```python\n")
    code = quick[start : quick.index("\n```", start)]
    assert len(code.splitlines()) <= 15, "the quick start is at most 15 lines"
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README quick start", "exec"), {})
    events = (tmp_path / "runs" / "quickstart" / "events.jsonl").read_text().splitlines()
    assert '"run_closed"' in events[-1]
