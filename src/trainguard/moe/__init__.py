"""Mixture-of-experts helpers: routing health, its collapse detector's input, per-expert
gradient spread, and auxiliary-loss-free load balancing."""

from trainguard.moe.balance import LoadBalancer
from trainguard.moe.routing import RoutingStats, expert_grad_norms, routing_stats

__all__ = ["LoadBalancer", "RoutingStats", "expert_grad_norms", "routing_stats"]
