"""Numeric precision policies (dtype of parameters, compute and outputs)."""

from hopperjax.precision.policy import Policy, get_policy

__all__ = ["Policy", "get_policy"]
