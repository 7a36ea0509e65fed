"""hopperjax: one functional JAX/Flax trainer where every optimization is a config key.

Library use::

    import hopperjax
    config = hopperjax.load_config("configs/quickstart.yaml", ["train.steps=20"])
    result = hopperjax.train(config)
"""

from hopperjax.config import Config, ConfigError, load_config
from hopperjax.data import build_datasets
from hopperjax.models import build_model
from hopperjax.optim import build_optimizer
from hopperjax.parallel import build_mesh, initialize_distributed, sharding_context
from hopperjax.precision import get_policy
from hopperjax.trainer import (
    Components,
    TrainResult,
    TrainState,
    build_components,
    create_train_state,
    eval_step,
    jit_steps,
    train,
    train_step,
)

__version__ = "0.1.0"

__all__ = [
    "Components",
    "Config",
    "ConfigError",
    "TrainResult",
    "TrainState",
    "build_components",
    "build_datasets",
    "build_mesh",
    "build_model",
    "build_optimizer",
    "create_train_state",
    "eval_step",
    "get_policy",
    "initialize_distributed",
    "jit_steps",
    "load_config",
    "sharding_context",
    "train",
    "train_step",
]
