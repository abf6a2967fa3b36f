"""Fix kits: stable inits, DeepNorm, RMSNorm, warmup-cosine with restarts, adaptive, unit-wise
and per-expert clipping, and z-loss; each named by the set-up lint where it applies."""

from trainguard.fixes.clipping import AdaptiveClipper, agc_, clip_per_expert_
from trainguard.fixes.init import DeepNormResidual, deepnorm_constants, deepnorm_init_, scaled_init_
from trainguard.fixes.losses import z_loss
from trainguard.fixes.norm import RMSNorm
from trainguard.fixes.schedule import WarmupCosineRestarts

__all__ = [
    "AdaptiveClipper",
    "DeepNormResidual",
    "RMSNorm",
    "WarmupCosineRestarts",
    "agc_",
    "clip_per_expert_",
    "deepnorm_constants",
    "deepnorm_init_",
    "scaled_init_",
    "z_loss",
]
