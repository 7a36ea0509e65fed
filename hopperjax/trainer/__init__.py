"""Train state, the pure steps, and the loop that drives them."""

from hopperjax.trainer.components import Components, build_components
from hopperjax.trainer.loop import TrainResult, train
from hopperjax.trainer.state import TrainState, create_train_state, state_shardings
from hopperjax.trainer.step import cross_entropy, eval_step, jit_steps, train_step

__all__ = [
    "Components",
    "TrainResult",
    "TrainState",
    "build_components",
    "create_train_state",
    "cross_entropy",
    "eval_step",
    "jit_steps",
    "state_shardings",
    "train",
    "train_step",
]
