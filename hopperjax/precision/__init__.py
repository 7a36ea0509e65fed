"""Numeric precision: dtype policies, dynamic loss scaling and FP8 backends."""

from hopperjax.precision.loss_scale import LossScaleState
from hopperjax.precision.policy import PEAK_DTYPE, Policy, get_policy, policy_from_config

__all__ = ["PEAK_DTYPE", "LossScaleState", "Policy", "get_policy", "policy_from_config"]
