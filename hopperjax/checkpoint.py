"""Checkpoints: train state and data-iterator state together, through orbax's CheckpointManager.

orbax writes each step into a temporary directory and renames it when complete, so a step
directory is either whole or absent; ``latest_step`` only ever sees whole ones. Saves are async:
the device arrays are copied to host and the loop continues while files are written.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath


class IteratorStateHandler(ocp.CheckpointHandler):
    """Saves each process's input-iterator state as ``process_<i>-of-<n>.json``.

    Every process owns a different slice of the data, so each writes and reads its own file.
    """

    def _file(self, directory: epath.Path) -> epath.Path:
        return directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"

    def save(self, directory: epath.Path, args: IteratorStateSave) -> None:
        self._file(directory).write_text(json.dumps(args.state))

    def restore(self, directory: epath.Path, args: IteratorStateRestore | None = None) -> Any:
        path = self._file(directory)
        if not path.exists():
            raise FileNotFoundError(
                f"{path}: no input-iterator state for this process; was the checkpoint written "
                f"with a different process count?"
            )
        return json.loads(path.read_text())


@ocp.args.register_with_handler(IteratorStateHandler, for_save=True)
@dataclasses.dataclass
class IteratorStateSave(ocp.args.CheckpointArgs):
    state: Any


@ocp.args.register_with_handler(IteratorStateHandler, for_restore=True)
@dataclasses.dataclass
class IteratorStateRestore(ocp.args.CheckpointArgs):
    pass


class Checkpointer:
    """Keep-last-K, every-N-steps checkpoints of ``(train state, data iterator state)``.

    Args:
      directory: where step directories go (created if missing).
      every: save when ``step % every == 0`` (``save(force=True)`` saves regardless).
      keep: how many of the newest checkpoints to keep.
      async_save: write files in the background.
    """

    def __init__(self, directory: str | Path, *, every: int, keep: int, async_save: bool = True):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._manager = ocp.CheckpointManager(Path(directory).absolute(), options=options)
        self._every = every

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, data_state: Any, *, force: bool = False) -> bool:
        """Starts saving if ``step`` is due (or ``force``); returns whether it did."""
        # The cadence is decided here: orbax's own interval logic also saves the first step.
        if not (force or step % self._every == 0) or step == self._manager.latest_step():
            return False
        return self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=IteratorStateSave(data_state)
            ),
            force=True,
        )

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, Any]:
        """Restores ``step`` straight into the shardings carried by ``abstract_state``.

        Returns:
          (train state, data iterator state)
        """
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=IteratorStateRestore()
            ),
        )
        return restored["state"], restored["data"]

    def wait(self) -> None:
        """Blocks until every started save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()
