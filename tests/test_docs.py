"""The docs stay true and navigable: the configuration reference matches `GuardConfig`."""

from __future__ import annotations

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
