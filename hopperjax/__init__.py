"""hopperjax: one functional JAX/Flax trainer where every optimization is a config key.

Library use::

    import hopperjax
    config = hopperjax.load_config("configs/quickstart.yaml", ["train.steps=20"])
    result = hopperjax.train(config)
    restored = hopperjax.restore_params(result.run_dir)   # model + variables, no optimizer

A task is a workload (``hopperjax.workloads``): ``workload: <name>`` in a config picks it, and
``hopperjax.workloads.register(name, cls)`` adds one from any package.
"""

from hopperjax import workloads
from hopperjax.config import Config, ConfigError, load_config
from hopperjax.infer import Restored, restore_params
from hopperjax.optim import build_optimizer
from hopperjax.parallel import build_mesh, initialize_distributed, sharding_context
from hopperjax.precision import get_policy
from hopperjax.trainer import (
    Components,
    TrainResult,
    TrainState,
    build_components,
    build_datasets,
    build_model,
    create_train_state,
    eval_step,
    jit_steps,
    train,
    train_step,
)
from hopperjax.workloads.base import Field, Workload

__version__ = "0.1.0"

__all__ = [
    "Components",
    "Config",
    "ConfigError",
    "Field",
    "Restored",
    "TrainResult",
    "TrainState",
    "Workload",
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
    "restore_params",
    "sharding_context",
    "train",
    "train_step",
    "workloads",
]
