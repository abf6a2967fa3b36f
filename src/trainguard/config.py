"""`GuardConfig`: every threshold of the guard with a documented default; loads YAML or TOML."""

from __future__ import annotations

import difflib
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeAlias

import numpy as np
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from trainguard.events import ConfigError, known_kinds

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LossSpikeConfig(_Section):
    """A jump of the loss far above its recent level (z-score rule) or a gross ratio over it."""

    enabled: bool = Field(True, description="Watch the loss for spikes.")
    window: int = Field(100, ge=8, description="Recent non-spike losses that form the baseline.")
    warmup: int = Field(20, ge=4, description="Observations before the detector arms.")
    z_threshold: float = Field(10.0, gt=0, description="Noise standard deviations over the level.")
    min_rel_jump: float = Field(
        0.05, ge=0, description="A z-score spike must also exceed the level by this fraction."
    )
    ratio_threshold: float = Field(2.0, gt=1, description="Loss over this x the baseline mean.")
    ratio_min_z: float = Field(
        5.0,
        ge=0,
        description="The ratio rule also needs the loss this many noise standard deviations over"
        " its level: a doubling alone is no evidence where the loss nears zero. Once the run's"
        " own baseline has doubled its recent mean (noise as large as the level), it needs the"
        " loss past the noise's reach too.",
    )
    level_window: int = Field(
        5,
        ge=1,
        description="Latest losses whose median is the level; it is never under the median of"
        " 4x as many, moved on by the drift, so a short dip does not drag it down.",
    )
    classify_window: int = Field(
        5, ge=1, description="Steps watched after a spike before its type is revised."
    )
    confirm_steps: int | None = Field(
        None,
        ge=0,
        description="Steps after a spike typed data toxicity that, each still far over its level"
        " (over `ratio_threshold` x it and over the spike's z threshold), revise it to a gradient"
        " explosion before `classify_window` is out: the next batches are not the bad one, so the"
        " weights are. None sizes it to the run: 2 where a rollback cannot rewind the data (no"
        " `guard.batches`), so that it loses fewer steps; else (and offline) the whole window,"
        " which lets a fault of a few steps end before the rollback replays them; 0: the window.",
    )
    noise_horizon: int = Field(
        1000, ge=10, description="Steps over which the long-run noise level is averaged."
    )
    persist_steps: int = Field(
        3, ge=2, description="Steps in a row over `persist_z` that make a spike below z_threshold."
    )
    persist_z: float = Field(
        5.0, gt=0, description="Noise standard deviations a lasting jump must keep above its level."
    )
    tail_quantile: float = Field(
        0.999,
        gt=0.5,
        lt=1,
        description="Quantile of past |z| from which the noise's heavy tails are read.",
    )
    noise_reach_steps: int = Field(
        200_000,
        ge=100,
        description="A z-score spike must clear what the noise reaches once in this many steps.",
    )


class GradSpikeConfig(_Section):
    """A global gradient norm far above its recent average."""

    enabled: bool = Field(True, description="Watch the global grad norm for spikes.")
    window: int = Field(
        100, ge=4, description="Recent non-spike grad norms whose median is the level."
    )
    warmup: int = Field(20, ge=2, description="Grad norms seen before the detector arms.")
    ratio_threshold: float = Field(
        5.0, gt=1, description="Grad norm over this x the median of recent non-spike norms."
    )
    reach_steps: int = Field(
        200_000,
        ge=100,
        description="The grad norm must also clear what the run's own grad-norm outliers reach"
        " once in this many steps (a power-law tail read from the run).",
    )
    min_log_z: float = Field(
        4.5,
        ge=0,
        description="And this many robust deviations (MAD) of the recent log grad norms over"
        " their median: noise evidence while few outliers are counted.",
    )
    abs_limit: float | None = Field(None, gt=0, description="Absolute grad-norm limit; off.")


class GradExplosionConfig(_Section):
    """A gradient norm that grows step after step, or passes an absolute limit."""

    enabled: bool = Field(
        True, description="Watch the grad norm for steady growth or an absolute limit."
    )
    growth_steps: int = Field(5, ge=2, description="Consecutive steps of growth.")
    growth_factor: float = Field(
        10.0, gt=1, description="Total growth over those steps, against the pre-growth level."
    )
    abs_limit: float | None = Field(None, gt=0, description="Absolute grad-norm limit; off.")


class WeightJumpConfig(_Section):
    """A layer group's weight norm that moves in one step far more than its own steps do: an LR
    far above its schedule, a write to the weights outside the optimizer, or corrupted memory,
    seen even where the loss does not move."""

    enabled: bool = Field(
        True, description="Measure each layer group's weight norm every step and judge its moves."
    )
    warmup: int = Field(20, ge=2, description="Steps a group is watched before it is judged.")
    window: int = Field(
        100,
        ge=10,
        description="Steps over which a group's largest one-step move is remembered (short, so "
        "the large moves of fresh weights early in training do not hide a burst later).",
    )
    min_ratio: float = Field(
        1.002,
        gt=1,
        description="A move under this factor (up or down) in one step never warns (an LR x100 "
        "moves a fitted model's weights by well under 1% a step).",
    )
    reach_factor: float = Field(
        2.0,
        gt=1,
        description="A move must pass this many times the group's largest one-step move in the "
        "window (log scale; a move is learned up to x2, so one write of x1000 leaves the next "
        "flagged).",
    )
    median_factor: float = Field(
        20.0,
        gt=1,
        description="And this many times the median of its last 50 moves (an LR x100 moves "
        "Adam's weights about 100x as far).",
    )


class VanishingConfig(_Section):
    """A layer group whose gradient norm fell far below its early level, or under a floor."""

    enabled: bool = Field(True, description="Watch each layer group's grad norm for vanishing.")
    reference_steps: int = Field(50, ge=1, description="Steps that set each group's early level.")
    ratio: float = Field(1e-3, gt=0, lt=1, description="Fraction of the early level.")
    abs_floor: float = Field(
        1e-8, ge=0, description="A grad norm under this vanishes whatever its early level."
    )
    patience: int = Field(20, ge=1, description="Consecutive steps below before it is reported.")


class StallConfig(_Section):
    """The loss improves by less than a relative tolerance over a long window, with confidence."""

    enabled: bool = Field(True, description="Watch the loss for a stall.")
    window: int = Field(2000, ge=20, description="Steps over which progress is measured.")
    blocks: int = Field(20, ge=5, description="Block means the trend line is fitted to.")
    rel_tol: float = Field(
        0.01, ge=0, description="Least relative improvement over the window that is progress."
    )


class DivergenceConfig(_Section):
    """The loss rises steadily over a window (Mann-Kendall trend test on block medians), by
    `min_rel_rise` and by more than the noise of a block median (`trends.RISE_NOISE`)."""

    enabled: bool = Field(True, description="Watch the loss for a steady rise.")
    window: int = Field(400, ge=20, description="Steps the rise must span, at least half of.")
    blocks: int = Field(20, ge=8, description="Blocks whose medians enter the trend test.")
    z_threshold: float = Field(3.5, gt=0, description="Mann-Kendall z for a rising trend.")
    min_rel_rise: float = Field(0.1, ge=0, description="Rise of the last block over the lowest.")


class OscillationConfig(_Section):
    """Periodic loss swings whose amplitude grows: already swinging (`min_acf`) in the earlier half
    of the window and still growing within the later half: a data bump that starts is no swing."""

    enabled: bool = Field(True, description="Watch the loss for growing periodic swings.")
    window: int = Field(200, ge=32, description="Latest losses examined for swings.")
    check_every: int = Field(25, ge=1, description="Steps between checks.")
    min_period: int = Field(4, ge=2, description="Shortest swing period, in steps.")
    min_acf: float = Field(0.5, gt=0, lt=1, description="Autocorrelation at the period.")
    growth: float = Field(1.5, gt=1, description="Amplitude of the later half over the earlier.")
    min_rel_amplitude: float = Field(
        0.02, ge=0, description="Swing amplitude as a fraction of the loss level."
    )


class EvalDeclineConfig(_Section):
    """An evaluation that worsens over its recent best while the training loss still falls
    (forgetting): both of its last two values against the best mean of two consecutive values
    before them over the last `window`, worse by `noise_sigmas` times its own noise and by
    `min_rel_decline`."""

    enabled: bool = Field(True, description="Watch evaluations (`guard.evaluate`) for a decline.")
    window: int = Field(
        16, ge=6, description="Latest evaluations of a name the best is taken over."
    )
    min_evals: int = Field(
        6, ge=4, description="Evaluations of a name before its decline is judged."
    )
    noise_sigmas: float = Field(
        5.0, gt=0, description="Decline over the best, in the evaluation's own noise."
    )
    min_rel_decline: float = Field(
        0.01, ge=0, le=1, description="Least decline over the best, relative to the best."
    )
    train_window: int = Field(
        256, ge=1, description="Latest training losses whose median is the train loss level."
    )


class TokenAccuracyConfig(_Section):
    """Token accuracy (`MetricPoint.token_accuracy`) below a healthy range learned from the run:
    under the median less `mad_sigmas` robust deviations of its last `window` values."""

    enabled: bool = Field(True, description="Watch token accuracy, where it is measured.")
    window: int = Field(64, ge=8, description="Latest healthy values the range is learned from.")
    warmup: int = Field(16, ge=4, description="Values seen before the range is judged.")
    mad_sigmas: float = Field(6.0, gt=0, description="Robust deviations under the median.")
    min_drop: float = Field(
        0.02,
        ge=0,
        le=1,
        description="Least drop under the median that is out of range (absolute).",
    )


class OverflowConfig(_Section):
    """fp16 loss-scale overflow: normal while the scaler calibrates, an incident if it persists."""

    patience: int = Field(20, ge=1, description="Consecutive overflow steps that are an incident.")
    min_loss_scale: float = Field(1.0, gt=0, description="A scale at or below this has collapsed.")


class HealthConfig(_Section):
    """Fixed absolute levels for the loss, the grad norm and the count of fp16 overflow steps
    (the original checks): off by default, as sensible levels depend on the model."""

    enabled: bool = Field(False, description="Check the absolute levels below (`health` events).")
    loss_warn: float = Field(5.0, description="A loss over this is a warning.")
    loss_danger: float = Field(10.0, description="A loss over this is critical.")
    grad_norm_warn: float = Field(2.0, description="A grad norm over this is a warning.")
    grad_norm_danger: float = Field(5.0, description="A grad norm over this is critical.")
    overflow_warn: int = Field(
        100, description="More fp16 overflow steps than this in the run is a warning."
    )
    overflow_danger: int = Field(
        1000, description="More fp16 overflow steps than this in the run is critical."
    )


class RanksConfig(_Section):
    """Per-rank checks in a distributed run: a rank whose loss or local grad norm (before the
    gradient reduction) is non-finite, or far out of line with the other ranks in a way this
    run's own history never showed (each rank's normal spread is learned from the run)."""

    enabled: bool = Field(True, description="Compare the ranks of a distributed run step by step.")
    exchange: Literal["reduce", "gather"] = Field(
        "reduce",
        description="How the ranks share each step's figures: `reduce`, two fixed-size "
        "reductions (a SUM, then a MAX that names the worst rank) whose cost does not grow "
        "with the world, each rank judged against its own line and the others' geometric mean; "
        "`gather`, an all-gather of one row per rank judged against the median of the others "
        "(the earlier exchange, kept for comparison; it grows with the world).",
    )
    ratio_threshold: float = Field(
        3.0,
        gt=1,
        description="And a rank's ratio to the others (their geometric mean under `reduce`, their "
        "median under `gather`) over this x its usual one.",
    )
    z_threshold: float = Field(
        6.0,
        gt=0,
        description="A rank's log-ratio to the others over this many of its own robust "
        "deviations (learned over `window` steps).",
    )
    reach_margin: float = Field(
        1.5,
        gt=1,
        description="And over this x the furthest any rank reached in the window (heavy tails).",
    )
    window: int = Field(
        200, ge=10, description="Steps of per-rank history the spread is read from."
    )
    min_history: int = Field(20, ge=5, description="Steps seen before the learned rule applies.")
    warmup_ratio: float = Field(
        50.0,
        gt=1,
        description="Until then, a rank over this x the others (as in `ratio_threshold`) is out "
        "of line.",
    )
    min_spread: float = Field(
        0.05,
        gt=0,
        description="The floor of a rank's normal spread, relative (0.05: 5% of the others' "
        "centre).",
    )


class StragglerConfig(_Section):
    """A rank slower than the others (their mean under `ranks.exchange: reduce`, their median under
    `gather`), window after window."""

    enabled: bool = Field(True, description="Report ranks that are slow window after window.")
    every: int = Field(20, ge=1, description="Steps per timing window.")
    factor: float = Field(
        1.5,
        gt=1,
        description="Mean step time over this x the other ranks' (their mean under `reduce`, their "
        "median under `gather`) is slow.",
    )
    windows: int = Field(3, ge=1, description="Slow windows in a row before it is reported.")


class ReplicasConfig(_Section):
    """Data-parallel replicas that must hold bit-identical weights: a fingerprint of each layer
    group's parameters compared across the data-parallel group every `every` steps; a rank whose
    weights differ from the majority's is given a copy of an agreeing replica, and with no
    majority the run halts."""

    every: int = Field(
        100,
        ge=0,
        description="Steps between checks (one all-reduce of 4 numbers a layer group, and one "
        "host transfer); 0 turns them off. Off where the parameters are sharded, not replicated "
        "(FSDP2, DeepSpeed ZeRO-3).",
    )


PRECURSOR_SIGNALS = ("max_logit", "attn_entropy", "block_rms", "adam_eps_ratio", "log_z")
FALLING_PRECURSORS = frozenset({"attn_entropy", "adam_eps_ratio"})  # critical from above
# the logits' last dimension at the output head, sent beside log Z (judged by no rule of its
# own): log Z is judged by its distance from ln(vocabulary)
VOCAB_SIZE = "vocab_size"


class PrecursorWarningConfig(_Section):
    """The `precursor` early warning: a layer's precursor near its critical level and heading
    there fast, read on the sampled steps (`precursors.every`)."""

    enabled: bool = Field(True, description="Warn on the precursors' trends where sampled.")
    critical: dict[str, float] = Field(
        default_factory=lambda: {
            "max_logit": 100.0,
            "attn_entropy": 0.1,
            "block_rms": 1000.0,
            "adam_eps_ratio": 1.0,
            "log_z": 30.0,
        },
        description="Each signal's critical level: attention collapses or the run diverges near"
        " it; attn_entropy and adam_eps_ratio fall towards theirs, log_z counts by its distance"
        " from ln(vocabulary).",
    )
    margin: float = Field(
        4.0, gt=1, description="A signal within this factor of its critical level may warn."
    )
    window: int = Field(12, ge=6, description="Latest samples whose robust trend is read.")
    trend_noise: float = Field(
        4.0,
        gt=0,
        description="The trend's rise over the window must exceed this many times the noise"
        " about it.",
    )
    horizon: int = Field(
        1000, ge=1, description="Warn only where the trend reaches critical within these steps."
    )
    confirm: int = Field(3, ge=1, description="Samples in a row that must meet every rule.")

    @field_validator("critical")
    @classmethod
    def _known_signals(cls, critical: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(critical) - set(PRECURSOR_SIGNALS))
        if unknown:
            raise ValueError(f"unknown precursor signals {unknown}; known: {PRECURSOR_SIGNALS}")
        if any(not v > 0 for v in critical.values()):
            raise ValueError("critical levels must be over 0")
        return critical


class PreemptConfig(_Section):
    """What the policy may do on a `precursor` warning, before the loss moves; off (no actions)
    by default: a false action costs more than a missed warning."""

    actions: list[Literal["lr_cut", "qk_rescale", "z_loss"]] = Field(
        default_factory=list,
        description="Preemptive actions, each at most once a warning episode a layer: 'lr_cut'"
        " (the LR x `lr_factor`, held there while a warmup would raise it), 'qk_rescale' (W_q"
        " and W_k of the layers past `qk_threshold` scaled so their max attention logit is"
        " `qk_target`; on a max_logit warning, then on every sampled step after it: max-logit"
        " clipping), 'z_loss' (z-loss switched on at `z_loss_weight`; log_z warnings only).",
    )
    lr_factor: float = Field(0.5, gt=0, lt=1, description="'lr_cut' multiplies the LR by this.")
    qk_threshold: float = Field(
        25.0,
        gt=0,
        description="'qk_rescale' rescales the layers whose max logit is over this (from the"
        " first max_logit warning on, on every sampled step).",
    )
    qk_target: float = Field(
        15.0, gt=0, description="'qk_rescale' brings a layer's max attention logit down to this."
    )
    z_loss_weight: float = Field(1e-4, gt=0, description="'z_loss' adds weight * log(Z)^2.")

    @field_validator("actions")
    @classmethod
    def _unique(cls, actions: list[str]) -> list[str]:
        if len(set(actions)) != len(actions):
            raise ValueError(f"preemptive actions listed twice: {actions}")
        return actions

    @model_validator(mode="after")
    def _target_below_threshold(self) -> PreemptConfig:
        if self.qk_target >= self.qk_threshold:
            raise ValueError(
                f"qk_target ({self.qk_target}) must lie under qk_threshold ({self.qk_threshold})"
            )
        return self


class PrecursorsConfig(_Section):
    """The precursors of divergence, measured on a sampled step through forward hooks on the
    step's first training forward: each attention layer's max logit and entropy, each block's
    output RMS, the output log-partition (log Z), token accuracy, and Adam's update-to-epsilon
    ratio per layer group; nothing is measured on the other steps."""

    enabled: bool = Field(
        True,
        description="Measure the precursors (needs a model; attention layers are found by "
        "structure: separate, fused or interleaved q/k projections, nn.MultiheadAttention).",
    )
    every: int = Field(
        50,
        ge=1,
        description="Steps between sampled steps: the hooks sit on the forward of steps "
        "0, every, 2*every, ... only (one extra collective then in a distributed run).",
    )
    max_sequences: int = Field(
        4, ge=1, description="Sequences of the sampled forward's batch that are measured."
    )
    max_queries: int = Field(
        128,
        ge=1,
        description="Query positions per sequence whose attention logits are measured, spread "
        "evenly over the sequence (the last always among them).",
    )
    adam_eps_ratio: bool = Field(
        True,
        description="Measure sqrt(mean v_hat)/eps per layer group from an Adam-like "
        "optimizer's state (exp_avg_sq): near 1 or below, eps damps the updates.",
    )
    warning: PrecursorWarningConfig = Field(
        default_factory=PrecursorWarningConfig,
        description="The `precursor` early warning on the sampled precursors' trends.",
    )
    preempt: PreemptConfig = Field(
        default_factory=PreemptConfig,
        description="Preemptive actions on a `precursor` warning (none by default).",
    )

    @model_validator(mode="after")
    def _preempt_needs_warnings(self) -> PrecursorsConfig:
        if self.preempt.actions and not (self.enabled and self.warning.enabled):
            off = "precursors.enabled" if not self.enabled else "precursors.warning.enabled"
            raise ValueError(
                f"preempt.actions {self.preempt.actions} act on precursor warnings, but {off} "
                "is false: switch it on or drop the actions"
            )
        return self


AlertChannel = Literal["webhook", "email", "console"]
REMOTE_CHANNELS: tuple[AlertChannel, ...] = ("webhook", "email")
MASK = "**********"  # how a secret is written out


def _unmasked(value: SecretStr | None) -> SecretStr | None:
    """A masked secret read back from a written config is no secret at all: unset."""
    return None if value is not None and value.get_secret_value() == MASK else value


class AlertRule(_Section):
    """Which events go to which alert sinks."""

    kinds: list[str] = Field(
        default_factory=list, description="Event kinds this rule matches; empty matches all."
    )
    min_severity: Literal["info", "warning", "critical"] = Field(
        "warning", description="Least severity this rule sends."
    )
    sinks: list[AlertChannel] = Field(
        default_factory=lambda: list(REMOTE_CHANNELS),
        description="Channels: webhook, email, console (the console prints incidents anyway).",
    )

    @field_validator("kinds")
    @classmethod
    def _known(cls, kinds: list[str]) -> list[str]:
        unknown = sorted(set(kinds) - set(known_kinds()))
        if unknown:
            raise ValueError(f"unknown event kinds {unknown}; known: {', '.join(known_kinds())}")
        return kinds


def _default_rules() -> list[AlertRule]:
    """The original checks: NaN, gradient explosion, fp16 overflow storms (a collapsed scale is a
    `nonfinite`), loss over 3 x its EMA (an `info` event: the guard takes no action on it); and
    anything critical, such as a halt."""
    return [
        AlertRule(kinds=["nonfinite", "grad_explosion"], min_severity="warning"),
        AlertRule(kinds=["loss_above_ema"], min_severity="info"),
        AlertRule(kinds=[], min_severity="critical"),
    ]


class WebhookConfig(_Section):
    """A Slack-compatible (or plain JSON) webhook; the URL is a secret."""

    url: SecretStr | None = Field(None, description="The URL; better given by `url_env`.")
    url_env: str = Field(
        "TRAINGUARD_WEBHOOK_URL", description="Environment variable holding the URL."
    )
    format: Literal["slack", "json"] = Field(
        "slack", description='Slack-compatible `{"text": ...}`, or the alert as JSON.'
    )
    timeout_s: float = Field(5.0, gt=0, description="Seconds one send may take.")

    _url = field_validator("url")(classmethod(lambda cls, v: _unmasked(v)))


class EmailConfig(_Section):
    """Alerts by SMTP with STARTTLS and login; the password is a secret."""

    host: str | None = Field(None, description="SMTP server; None is off.")
    port: int = Field(587, ge=1, le=65535, description="SMTP port.")
    starttls: bool = Field(True, description="Upgrade the connection with STARTTLS.")
    user: str | None = Field(None, description="Login user; None sends without login.")
    password: SecretStr | None = Field(None, description="Better given by `password_env`.")
    password_env: str = Field(
        "TRAINGUARD_SMTP_PASSWORD", description="Environment variable holding the password."
    )
    cafile: str | None = Field(None, description="CA bundle to verify the server (STARTTLS).")
    sender: str = Field("trainguard@localhost", description="The From address.")
    to: list[str] = Field(default_factory=list, description="Recipients (needed with `host`).")
    timeout_s: float = Field(10.0, gt=0, description="Seconds one send may take.")

    _password = field_validator("password")(classmethod(lambda cls, v: _unmasked(v)))


class AlertsConfig(_Section):
    """Alerts and metrics sinks: rules, deduplication, delivery, and where each sink goes."""

    rules: list[AlertRule] = Field(
        default_factory=_default_rules,
        description="Which events go to which channels (see `alerts.rules[]`); the default sends "
        "NaNs, gradient explosions and loss over its EMA at warning, and anything critical.",
    )
    interval_s: float = Field(
        600.0, ge=0, description="The same kind at most once per this many seconds per sink."
    )
    loss_ema_ratio: float = Field(
        3.0,
        gt=1,
        description="A loss over this many times its EMA is a `loss_above_ema` event (info: the "
        "guard takes no action), raised while an alert rule routes that kind.",
    )
    loss_ema_alpha: float = Field(
        0.01, gt=0, lt=1, description="Smoothing factor of that EMA (weight of the newest loss)."
    )
    queue_size: int = Field(100, ge=1, description="Alerts waiting to be sent, at most.")
    retries: int = Field(3, ge=0, description="Retries of a failed send, per alert.")
    backoff_s: float = Field(1.0, ge=0, description="First retry delay; doubles each time.")
    webhook: WebhookConfig = Field(default_factory=WebhookConfig)
    email: EmailConfig = Field(default_factory=EmailConfig)
    prometheus_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Serve /metrics on this port (0 picks a free one); None is off.",
    )
    prometheus_addr: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Address /metrics listens on. The default serves this host only (a local "
        "Prometheus or an SSH tunnel), so figures are not open to the network unasked; "
        '"0.0.0.0" (or "::") serves a scraper on another host.',
    )
    tensorboard_dir: str | None = Field(None, description="Write TensorBoard events here.")
    wandb_project: str | None = Field(
        None, description="Log to this Weights & Biases project (trainguard[wandb]); None is off."
    )
    wandb_mode: Literal["online", "offline", "disabled"] = Field(
        "online", description="The W&B run's mode."
    )


class RoutingConfig(_Section):
    """A mixture-of-experts router collapsing onto a few experts."""

    enabled: bool = Field(
        True, description="Watch a mixture-of-experts router (fed by `guard.step(routing=...)`)."
    )
    reference_steps: int = Field(20, ge=1, description="Steps that set the early entropy.")
    entropy_fraction: float = Field(
        0.5, gt=0, lt=1, description="Entropy under this fraction of its early level."
    )
    max_share: float = Field(0.6, gt=0, le=1, description="One expert's share of the tokens.")
    patience: int = Field(5, ge=1, description="Steps in a row collapsed before it is reported.")


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_memory(value: str | int | float) -> tuple[float, bool]:
    """A memory setting as `(amount, is_share)`: "25%" is a share of the node's available memory
    (0.25, True); "40GB", "12GiB", "512MiB" or a number are bytes (per node). ValueError with
    what is accepted otherwise."""
    if isinstance(value, bool):
        raise ValueError("a memory size must be bytes, a size such as '40GB', or a share '25%'")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("a memory size cannot be negative")
        return float(value), False
    text = value.strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100
        except ValueError:
            share = -1.0
        if not 0 <= share <= 1:
            raise ValueError(f"{value!r}: a share of memory is between '0%' and '100%'")
        return share, True
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{value!r} is not a memory size: give bytes, a size such as '40GB' or '12GiB', "
            "or a share of the node's available memory such as '25%'"
        )
    return float(match.group(1)) * _UNITS[unit], False


class RecoveryConfig(_Section):
    """Snapshots and rollback: how far back, how much LR, how much data to skip. Sizes that
    depend on the run's length are sized to it: from `diagnosis.total_steps` when given, else
    from `len()` of the data given to `guard.batches`, else the defaults below."""

    enabled: bool = Field(True, description="Take snapshots and roll back; off means skip only.")
    snapshot_every: int | None = Field(
        None,
        ge=1,
        description="Steps between in-memory snapshots; None sizes it to the run: 1/20 of the "
        "planned steps, between 10 and 50 (50 when the length is unknown), and shorter where the "
        "data cannot be rewound, as `snapshot_budget` allows.",
    )
    snapshots: int = Field(
        3,
        ge=1,
        description="Snapshots kept in the ring, at most: fewer where `snapshot_memory` holds "
        "fewer.",
    )
    snapshot_memory: str | int = Field(
        "25%",
        description="Host memory for snapshots on each node, split evenly between its ranks "
        "(torchrun's LOCAL_WORLD_SIZE): a share of the memory available at the first update "
        "('25%'), or a size ('40GB', '12GiB', bytes), never more than is available. A snapshot "
        "takes the bytes of the model's and the optimizer's state on this rank (about 12 a "
        "parameter with fp32 AdamW), pinned once; the ring keeps as many as fit, at a longer "
        "interval when fewer than `snapshots` do; where at most one fits, a rollback it cannot "
        "serve goes to the newest known-good durable checkpoint, else the LR is cut.",
    )
    snapshot_budget: float = Field(
        0.01,
        ge=0,
        le=1,
        description="Where the data cannot be rewound (no `guard.batches`: the Trainer "
        "integrations, or a loop that does not use it) a rollback loses every step since its "
        "target, so with `snapshot_every` None snapshots come as often as this share of the "
        "training time allows (their measured cost against the measured step time), never "
        "more often than keeps one from before a spike's follow-up in the ring; 0 keeps the "
        "sized interval.",
    )
    rollback_margin: int = Field(
        10,
        ge=0,
        description="A rollback target lies this many steps before the incident where a snapshot "
        "that old is kept; else the newest one at or before the incident's first step is used.",
    )
    sudden_margin: int = Field(
        1,
        ge=0,
        description="The margin instead, for an explosion that began with a sudden jump (a spike "
        "first typed data toxicity, its follow-up revising it): the update before the jump made "
        "it, and steps further back are learning lost where the data cannot be rewound.",
    )
    skip_after_toxicity: int = Field(
        0, ge=0, description="Batches skipped after the incident batch for data toxicity."
    )
    skip_after_explosion: int = Field(
        200,
        ge=0,
        description="Batches skipped after the incident batch for other incidents, at most: "
        "never more than `skip_share` of the batches left.",
    )
    skip_share: float = Field(
        0.02,
        gt=0,
        le=1,
        description="A rollback skips at most this share of the batches left in the data (at "
        "least 1; never past its end): of len(data) when known, else of the planned steps "
        "left, else of the steps made so far.",
    )
    rewarm_steps: int | None = Field(
        None,
        ge=0,
        description="Steps over which the LR cut of a first rollback climbs back to the "
        "schedule (a rollback repeated within `rollback_window` keeps its cut, unless it comes "
        "within `snapshot_every` steps of the last one, the same fault still going on, whose "
        "compounded cut climbs back too); None "
        "sizes it "
        "to the run: 2x `snapshot_every`; 0 keeps every cut.",
    )
    max_rollbacks: int = Field(5, ge=1, description="Rollbacks within the window before a halt.")
    rollback_window: int = Field(1000, ge=1, description="Steps over which rollbacks are counted.")
    nonfinite_rollback: int = Field(
        3, ge=1, description="Non-finite steps within `nonfinite_window` that roll back."
    )
    nonfinite_window: int = Field(
        50, ge=1, description="Steps over which non-finite steps are counted for a rollback."
    )
    architecture_rollbacks: int = Field(
        2, ge=1, description="Rollbacks an architecture-type fault survives before a halt."
    )
    checkpoint_every: int = Field(
        500,
        ge=0,
        description="Steps between durable checkpoints in run_dir; 0: none by steps "
        "(`checkpoint_every_s` still applies).",
    )
    checkpoint_every_s: float | None = Field(
        None,
        gt=0,
        description="Wall-clock seconds between durable checkpoints in run_dir (e.g. 1800), "
        "whichever of this and `checkpoint_every` comes first; None: by steps only. In a "
        "distributed run every rank checkpoints at the same step: the first rank whose clock "
        "says it is due makes it due on all (decided in the step's exchange).",
    )
    keep_checkpoints: int = Field(3, ge=1, description="Newest complete checkpoints kept.")
    async_checkpoints: bool = Field(
        True, description="Write checkpoints in the background; training blocks only to stage."
    )
    dedup_checkpoints: bool = Field(
        True,
        description="Store each tensor's bytes once, in blobs shared by the checkpoints, so that "
        "a tensor unchanged since the last checkpoint (a frozen weight) is not written again; "
        "off writes every tensor into each checkpoint's folder.",
    )

    @field_validator("snapshot_memory")
    @classmethod
    def _memory_size(cls, value: str | int) -> str | int:
        parse_memory(value)  # a ValueError says what is accepted
        return value

    def sized(self, planned_steps: int | None) -> RecoveryConfig:
        """A copy with the sizes left to the run (None) filled in for a run of `planned_steps`
        (None: unknown length)."""
        every = self.snapshot_every
        if every is None:
            every = 50 if planned_steps is None else min(50, max(10, planned_steps // 20))
        rewarm = 2 * every if self.rewarm_steps is None else self.rewarm_steps
        return self.model_copy(update={"snapshot_every": every, "rewarm_steps": rewarm})


class DiagnosisConfig(_Section):
    """Tracing a NaN's origin, and naming the samples behind a loss spike."""

    trace_every: int = Field(
        50, ge=1, description="Steps between NaN-origin replays: a NaN streak is traced once."
    )
    sample_z: float = Field(
        5.0, gt=0, description="Robust z within the batch that blames a sample for a spike."
    )
    sample_perplexity: float | None = Field(
        None, gt=1, description="Also blame samples with a perplexity over this; off."
    )
    sample_min_excess: float = Field(
        1.0,
        ge=0,
        description="A blamed sample's loss is at least this far above the batch median, in the "
        "loss's units (1 nat of cross-entropy); set it for losses on another scale (MSE).",
    )
    sample_relative_spread: float = Field(
        0.1,
        ge=0,
        description="Floor of the robust spread the sample z uses, as a share of the median "
        "loss: a fitted batch's MAD is ~0.",
    )
    lint: bool = Field(True, description="Lint the set-up once at the start (info events).")
    total_steps: int | None = Field(
        None,
        ge=1,
        description="Planned optimizer steps: the lint's warmup check, the progress bar, and the "
        "recovery sizes (snapshot interval, data skips) of a run of this length.",
    )
    autocast_dtype: Literal["float16", "bfloat16"] | None = Field(
        None, description="'float16' or 'bfloat16' when the forward runs under autocast."
    )


class PolicyConfig(_Section):
    """How events become actions."""

    skip_on: list[str] = Field(
        default_factory=lambda: ["loss_spike", "grad_spike", "rank_outlier"],
        description="Event kinds whose step is skipped (non-finite gradients always are).",
    )
    halt_on: list[str] = Field(default_factory=list, description="Event kinds that halt the run.")
    max_consecutive_skips: int = Field(
        3, ge=0, description="Spike skips in a row before the guard steps again."
    )
    max_consecutive_nonfinite: int = Field(
        5, ge=1, description="Non-finite steps in a row that halt the run."
    )
    quarantine: bool = Field(
        True,
        description="Quarantine a batch for good (quarantine.jsonl) when its spike cleared the "
        "noise (z over its threshold) and the spike's follow-up confirmed data toxicity; until "
        "then it is only skipped, and a later revision of the type releases it. Off: skip only.",
    )

    @field_validator("skip_on", "halt_on")
    @classmethod
    def _known_kinds(cls, kinds: list[str]) -> list[str]:
        unknown = sorted(set(kinds) - set(known_kinds()))
        if unknown:
            raise ValueError(f"unknown event kinds {unknown}; known: {', '.join(known_kinds())}")
        return kinds


DEFAULT_GROUP_PATTERNS = [r"^(?P<group>.*?\.\d+)\.", r"^(?P<group>[^.]+)"]


class GuardConfig(_Section):
    """Every setting of the guard; `GuardConfig.load(path)` reads YAML or TOML."""

    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip threshold; None turns off.")
    hot_path: Literal["auto", "sync", "lagged"] = Field(
        "auto",
        description="How `guard.step` reads a step's figures. 'lagged': the skip is decided on "
        "the device (through a fused optimizer's `found_inf`) and the host judges each step "
        "one call later, with no blocking read on an ordinary step; 'sync': read and judged "
        "before the update (one blocking read a step); 'auto': lagged on a GPU with a fused "
        "Adam, AdamW, SGD or Adagrad and no GradScaler outside a distributed run, sync "
        "otherwise (said once at start).",
    )
    stats_every: int = Field(
        10, ge=0, description="Steps between parameter-norm and update-ratio samples; 0 is off."
    )
    log_every: int = Field(1, ge=1, description="Steps between lines of metrics.jsonl.")
    console: bool = Field(True, description="Print warnings and incidents on the console.")
    console_status: bool = Field(
        True,
        description="A live status line (and a progress bar with ETA when "
        "diagnosis.total_steps is set) while the console is a terminal.",
    )
    group_patterns: list[str] = Field(
        default_factory=lambda: list(DEFAULT_GROUP_PATTERNS),
        description="Regexes over parameter names; the first match names the layer group.",
    )
    loss_spike: LossSpikeConfig = Field(default_factory=LossSpikeConfig)
    grad_spike: GradSpikeConfig = Field(default_factory=GradSpikeConfig)
    grad_explosion: GradExplosionConfig = Field(default_factory=GradExplosionConfig)
    vanishing: VanishingConfig = Field(default_factory=VanishingConfig)
    weight_jump: WeightJumpConfig = Field(default_factory=WeightJumpConfig)
    stall: StallConfig = Field(default_factory=StallConfig)
    divergence: DivergenceConfig = Field(default_factory=DivergenceConfig)
    oscillation: OscillationConfig = Field(default_factory=OscillationConfig)
    eval_decline: EvalDeclineConfig = Field(default_factory=EvalDeclineConfig)
    token_accuracy: TokenAccuracyConfig = Field(default_factory=TokenAccuracyConfig)
    overflow: OverflowConfig = Field(default_factory=OverflowConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    ranks: RanksConfig = Field(default_factory=RanksConfig)
    straggler: StragglerConfig = Field(default_factory=StragglerConfig)
    replicas: ReplicasConfig = Field(default_factory=ReplicasConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    precursors: PrecursorsConfig = Field(default_factory=PrecursorsConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    diagnosis: DiagnosisConfig = Field(default_factory=DiagnosisConfig)
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)

    @field_validator("group_patterns")
    @classmethod
    def _valid_patterns(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"group pattern {pattern!r} is not a valid regex: {exc}") from exc
        return patterns

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> GuardConfig:
        """Validate a mapping, turning pydantic's report into one line that names the field."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(_printable(p) for p in first["loc"]) or "(top level)"
            more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
            what = first["msg"].removeprefix("Value error, ")  # our validators' own words
            if first["type"] == "extra_forbidden":
                what = "no such setting" + _did_you_mean(cls, first["loc"])
            raise ConfigError(
                f"{source}: {where}: {what}{more}; fix that field or remove it"
            ) from None

    @classmethod
    def of(cls, config: ConfigInput) -> GuardConfig:
        """A config as given to a guard: itself, the defaults for None, a mapping validated, or the
        path of a YAML/TOML file read; anything else is a one-line ConfigError."""
        if config is None:
            return cls()
        if isinstance(config, GuardConfig):
            return config
        if isinstance(config, Mapping):
            return cls.from_dict(dict(config))
        if isinstance(config, (str, Path)):
            return cls.load(config)
        raise ConfigError(
            f"config must be a GuardConfig, a mapping of settings or the path of a YAML/TOML "
            f"file, not a {_kind_of(config)}"
        )

    @classmethod
    def load(cls, path: str | Path) -> GuardConfig:
        """Read a YAML (.yaml/.yml) or TOML (.toml) file; JSON is accepted as YAML."""
        p = Path(path)
        data = _parse(p, _read_text(p))
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(
                f"{p}: the top level must be a mapping of settings, not a {_kind_of(data)}"
            )
        return cls.from_dict(data, source=str(p))

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True)


# what a guard accepts as its config (`GuardConfig.of`)
ConfigInput: TypeAlias = "GuardConfig | Mapping[str, Any] | str | Path | None"

MAX_CONFIG_DEPTH = 50  # a config nests 3 levels; deeper input is refused before it is parsed


def _read_text(p: Path) -> str:
    """The text of a config file, or a one-line error that says what is wrong with the path."""
    if p.is_dir():
        raise ConfigError(f"{p} is a directory: pass the path of a YAML or TOML config file")
    if not p.exists():
        raise ConfigError(f"config file not found: {p}; pass the path of a YAML or TOML file")
    if not p.is_file():
        raise ConfigError(f"{p} is not a regular file: pass the path of a YAML or TOML file")
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"cannot read {p}: {exc.strerror or exc}; check the path and its permissions"
        ) from None
    try:
        return raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{p} is not UTF-8 text (byte {exc.start + 1} is not UTF-8): save it as UTF-8"
        ) from None


def _parse(p: Path, text: str) -> Any:
    """The TOML (.toml) or YAML (any other suffix) document of `text`; a syntax error, nesting
    deeper than `MAX_CONFIG_DEPTH` or a number past Python's digit limit is one ConfigError."""
    toml = p.suffix.lower() == ".toml"
    kind = p.suffix.lstrip(".") or "YAML"
    if _nesting_bound(text) > MAX_CONFIG_DEPTH:
        raise ConfigError(
            f"{p}: nested over {MAX_CONFIG_DEPTH} levels deep, which no trainguard config is: "
            "check that it is the right file"
        )
    try:
        return tomllib.loads(text) if toml else yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{p}: not valid {kind}: {line}") from None
    except RecursionError:
        raise ConfigError(
            f"{p}: nested too deeply to be a trainguard config: check that it is the right file"
        ) from None
    except ValueError as exc:  # the parsers' int() of a number past Python's digit limit
        what = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "digits" in what:
            what = "a number has more digits than Python reads (4300)"
        raise ConfigError(f"{p}: not valid {kind}: {what}") from None


def _nesting_bound(text: str) -> int:
    """How deep flow brackets (YAML's [ and {, TOML's arrays and inline tables) nest in `text`,
    or less when closing ones come first; quotes and comments are not told apart. A cheap check
    that spares the parsers a deep recursion."""
    codes = np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)
    opens = (codes == ord("[")) | (codes == ord("{"))
    closes = (codes == ord("]")) | (codes == ord("}"))
    if not opens.any():
        return 0
    return int(np.cumsum(opens[opens | closes].astype(np.int64) * 2 - 1).max())


def _did_you_mean(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """ " (did you mean X?)" for an unknown key at `loc`, X the closest setting of its section."""
    for key in loc[:-1]:
        field = model.model_fields.get(str(key))
        section = field.annotation if field is not None else None
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            return ""
        model = section
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _printable(key: Any) -> str:
    """A key as an error names it: as it is, or quoted with escapes when it holds a newline or
    another unprintable character, so that the error stays on one line."""
    text = str(key)
    return text if text.isprintable() else repr(text)


def _kind_of(value: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(
        type(value), type(value).__name__
    )
