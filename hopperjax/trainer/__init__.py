"""Train state, the pure steps, and the loop that drives them; nothing here names a workload."""

from hopperjax.trainer.components import (
    Components,
    build_components,
    build_datasets,
    build_model,
)
from hopperjax.trainer.loop import TrainResult, train
from hopperjax.trainer.state import (
    TrainState,
    create_train_state,
    init_sharded,
    initializer,
    shardings_of,
)
from hopperjax.trainer.step import eval_step, jit_steps, train_step

__all__ = [
    "Components",
    "TrainResult",
    "TrainState",
    "build_components",
    "build_datasets",
    "build_model",
    "create_train_state",
    "eval_step",
    "init_sharded",
    "initializer",
    "jit_steps",
    "shardings_of",
    "train",
    "train_step",
]
