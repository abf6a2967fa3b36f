"""GuardConfig: defaults, YAML and TOML files, and one-line errors for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard.config import GuardConfig
from trainguard.events import ConfigError


def test_every_threshold_has_a_documented_default():
    cfg = GuardConfig()
    assert cfg.max_grad_norm == 1.0 and cfg.stats_every == 10 and cfg.log_every == 1
    assert cfg.loss_spike.z_threshold == 10.0 and cfg.loss_spike.ratio_threshold == 2.0
    assert cfg.grad_spike.ratio_threshold == 5.0 and cfg.grad_spike.abs_limit is None
    assert cfg.vanishing.abs_floor == 1e-8
    assert cfg.health.enabled is False and cfg.health.loss_warn == 5.0
    assert cfg.health.overflow_danger == 1000
    for section in (cfg.loss_spike, cfg.grad_spike, cfg.stall, cfg.divergence, cfg.oscillation):
        fields = type(section).model_fields
        documented = [name for name, f in fields.items() if f.description]
        assert len(documented) >= len(fields) // 2, type(section).__name__
        assert type(section).__doc__


def test_yaml_and_toml_load_the_same(tmp_path):
    yaml_file = tmp_path / "guard.yaml"
    yaml_file.write_text(
        "max_grad_norm: null\n"
        "loss_spike:\n  z_threshold: 8\n  window: 50\n"
        "health:\n  enabled: true\n"
        "policy:\n  halt_on: [divergence]\n"
    )
    toml_file = tmp_path / "guard.toml"
    toml_file.write_text(
        "[loss_spike]\nz_threshold = 8\nwindow = 50\n"
        "[health]\nenabled = true\n"
        '[policy]\nhalt_on = ["divergence"]\n'
    )
    a = GuardConfig.load(yaml_file)
    b = GuardConfig.load(toml_file).model_copy(update={"max_grad_norm": None})
    assert a == b
    assert a.max_grad_norm is None and a.loss_spike.z_threshold == 8 and a.health.enabled
    assert a.policy.halt_on == ["divergence"]


def test_empty_file_means_defaults(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert GuardConfig.load(empty) == GuardConfig()


@pytest.mark.parametrize(
    ("text", "suffix", "fragment"),
    [
        ("loss_spike:\n  z_treshold: 3\n", ".yaml", "loss_spike.z_treshold"),
        ("loss_spike:\n  window: many\n", ".yaml", "loss_spike.window"),
        ("max_grad_norm: -1\n", ".yaml", "max_grad_norm"),
        ("policy:\n  skip_on: [typo]\n", ".yaml", "unknown event kinds"),
        ("group_patterns: ['(']\n", ".yaml", "not a valid regex"),
        ("- a\n- b\n", ".yaml", "top level must be a mapping"),
        ("loss_spike: [\n", ".yaml", "not valid yaml"),
        ("[loss_spike\n", ".toml", "not valid toml"),
    ],
)
def test_bad_config_is_one_clear_line(tmp_path, text, suffix, fragment):
    path = tmp_path / f"bad{suffix}"
    path.write_text(text)
    with pytest.raises(tg.ConfigError) as info:
        GuardConfig.load(path)
    message = str(info.value)
    assert fragment in message and "\n" not in message and str(path) in message


def test_missing_file(tmp_path):
    with pytest.raises(tg.ConfigError, match="config file not found"):
        GuardConfig.load(tmp_path / "nope.yaml")


def test_a_guard_takes_a_mapping_or_a_path_and_refuses_anything_else(tmp_path: Path) -> None:
    """Guard(config=...) validates a dict and reads a YAML path as GuardConfig.load does; a bad
    field or a wrong type is one ConfigError line naming it, never an AttributeError."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = tg.Guard(model, opt, config={"max_grad_norm": 3.0}, run_dir=tmp_path / "a")
    assert guard.config.max_grad_norm == 3.0
    guard.close()
    path = tmp_path / "guard.yaml"
    path.write_text("max_grad_norm: 2.5\n")
    guard = tg.Guard(model, opt, config=str(path), run_dir=tmp_path / "b")
    assert guard.config.max_grad_norm == 2.5
    guard.close()
    with pytest.raises(ConfigError, match=r"^config: max_grad_norm: .*fix that field") as bad:
        tg.Guard(model, opt, config={"max_grad_norm": "lots"}, run_dir=tmp_path / "c")
    assert "\n" not in str(bad.value)
    with pytest.raises(ConfigError, match=r"config must be a GuardConfig, a mapping .* not a list"):
        tg.Monitor(config=[1, 2], run_dir=tmp_path / "d")  # type: ignore[arg-type]


def test_an_unknown_setting_is_named_with_the_closest_known_one() -> None:
    with pytest.raises(ConfigError) as caught:
        GuardConfig.from_dict({"eval_decline": {"noise_sigma": 3}})
    assert str(caught.value) == (
        "config: eval_decline.noise_sigma: no such setting (did you mean 'noise_sigmas'?); "
        "fix that field or remove it"
    )
    with pytest.raises(ConfigError, match=r"precursors\.preempt\.action: .*'actions'"):
        GuardConfig.from_dict({"precursors": {"preempt": {"action": ["lr_cut"]}}})
    with pytest.raises(ConfigError, match=r"loss_spike\.zzz: no such setting; fix"):
        GuardConfig.from_dict({"loss_spike": {"zzz": 1}})
