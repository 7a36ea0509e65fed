"""Checkpoints: train state and data-iterator state together, through orbax's CheckpointManager.

orbax writes each step into a temporary directory and renames it when complete, so a step
directory is either whole or absent. Saves are async: the device arrays are copied to host and
the loop continues while files are written.

On top of orbax, a checkpoint is only ever *trusted* when it verifies:

- nothing non-finite is saved: ``save`` checks the state on device first and refuses;
- once a save is on disk, ``manifest.json`` in its step directory records every file's size and
  SHA-256 (written in the background, atomically); a step without one never finished;
- ``resume_step`` re-hashes the newest checkpoints and returns the newest that verifies; newer ones
  that do not are moved to ``checkpoints.damaged/`` with one line saying why;
- a save that cannot be written (disk full, read-only directory) is reported as one line within
  a step of failing (``poll``), its temporary directory removed, the previous checkpoints intact.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from hopperjax import files

MANIFEST = "manifest.json"
# Where checkpoints that fail verification are moved (beside ``checkpoints/``), kept for a look.
DAMAGED = "checkpoints.damaged"
# The operating system's reason inside orbax/tensorstore's long error texts.
_OS_ERRORS = re.compile(
    r"No space left on device|Disk quota exceeded|Read-only file system|Permission denied"
)

# orbax splits the write of an array held whole by several devices among them ("replica
# parallel"), one sliced copy per device. Below this size per slice the copies cost more than they
# save: with 8 devices a small model's save compiled ~190 slice programs (4 s of a 15 s CPU run).
REPLICA_PARALLEL_MIN_SLICE_BYTES = 1 << 20


def _state_handler() -> ocp.PyTreeCheckpointHandler:
    handlers = ocp.type_handlers
    registry = handlers.create_type_handler_registry(
        (int, handlers.ScalarHandler()),
        (float, handlers.ScalarHandler()),
        (np.number, handlers.ScalarHandler()),
        (np.ndarray, handlers.NumpyHandler()),
        (
            jax.Array,
            handlers.ArrayHandler(
                min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_SLICE_BYTES
            ),
        ),
    )
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def _restore_args(abstract: Any) -> Any:
    """Restore arguments that place every array straight into its abstract leaf's sharding."""
    return jax.tree.map(
        lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype),
        abstract,
    )


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


class CheckpointError(Exception):
    """A checkpoint that cannot be written, or no checkpoint that verifies; one line."""


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


# Rewritten by orbax when it commits a save (after the in-flight manifest is written).
_COMMIT_FILES = frozenset({"_CHECKPOINT_METADATA", "commit_success.txt"})


def write_manifest(
    step_dir: Path, *, skip: frozenset[str] = frozenset(), extend: bool = False
) -> None:
    """Records size and SHA-256 of every file of a finished step directory (but the top-level
    ``skip`` names). ``extend``: keep what an existing manifest records and hash only the files
    it lacks."""
    entries = {}
    if extend:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            entries = json.loads((step_dir / MANIFEST).read_text())["files"]
    for p in _files(step_dir):
        name = str(p.relative_to(step_dir))
        if name not in entries and name not in skip:
            entries[name] = {"bytes": p.stat().st_size, "sha256": files.digest(p)}
    files.write_text(step_dir / MANIFEST, json.dumps({"files": entries}, indent=1) + "\n")


def verify(step_dir: Path) -> str | None:
    """What is wrong with a step directory (one phrase), or None when every file matches its
    manifest."""
    try:
        entries = json.loads((step_dir / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return "it has no manifest (its save never finished)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its manifest is unreadable ({type(e).__name__})"
    for name, want in sorted(entries.items()):
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{name} has {size} bytes, not {want['bytes']}"
        if files.digest(path) != want["sha256"]:
            return f"{name} does not match its checksum"
    return None


def newest_verified(directory: Path, steps: list[int]) -> tuple[int | None, list[tuple[int, str]]]:
    """The newest of ``steps`` whose step directory verifies (None: none does), and what is wrong
    with each newer one, newest first."""
    problems = []
    for step in sorted(steps, reverse=True):
        problem = verify(Path(directory) / str(step))
        if problem is None:
            return step, problems
        problems.append((step, problem))
    return None, problems


def _barrier(name: str) -> None:
    """Every process waits here (nothing to wait for in a single-process run)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


@jax.jit
def _all_finite(state: Any) -> jax.Array:
    leaves = [
        jnp.isfinite(x).all()
        for x in jax.tree.leaves(state)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)


def _state_bytes(state: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if hasattr(x, "dtype"))


class Checkpointer:
    """Keep-last-K, every-N-steps checkpoints of ``(train state, data iterator state)``.

    Args:
      directory: where step directories go (created if missing).
      every: save when ``step % every == 0`` (``save(force=True)`` saves regardless).
      keep: how many of the newest checkpoints to keep.
      async_save: write files in the background.
      primary: this process writes manifests and moves damaged checkpoints (default: process 0).
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        every: int,
        keep: int,
        async_save: bool = True,
        primary: bool | None = None,
    ):
        self._directory = Path(directory).absolute()
        self._primary = jax.process_index() == 0 if primary is None else primary
        self._pending: list[tuple[int, int]] = []  # (step, bytes) of saves not yet on disk
        # Hashed in orbax's finalizing thread, right after a save is committed (before the next
        # save may start): a kill can then leave at most the newest checkpoint without its
        # manifest, never an older one too.
        async_options = (
            ocp.AsyncOptions(post_finalization_callback=self._hash_committed)
            if async_save
            else None
        )
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,
            async_options=async_options,
        )
        # Handlers named up front, so that a manager that has not saved yet can read metadata.
        self._manager = ocp.CheckpointManager(
            self._directory,
            options=options,
            item_handlers={
                "state": _state_handler(),
                "data": IteratorStateHandler(),
            },
        )
        self._every = every
        self._hashing = concurrent.futures.ThreadPoolExecutor(1, "hopperjax-manifest")
        self._manifests: list[concurrent.futures.Future] = []

    @property
    def directory(self) -> Path:
        return self._directory

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def last_good_step(self) -> int | None:
        """The newest step whose save finished and whose manifest was written (not re-hashed)."""
        good = [s for s in self.all_steps() if (self._directory / str(s) / MANIFEST).is_file()]
        return max(good, default=None)

    def describe_last_good(self) -> str:
        """Names the checkpoint to go back to (for error messages)."""
        step = self.last_good_step()
        if step is None:
            return "there is no checkpoint yet"
        return f"the last good checkpoint is step {step} in {self._directory}"

    def resume_step(self, info: Callable[[str], None] = print) -> int | None:
        """The newest checkpoint that verifies (None: there are no checkpoints).

        Newer ones that do not verify are moved to ``checkpoints.damaged/`` (by the primary
        process), each with one ``info`` line.

        Raises:
          CheckpointError: there are checkpoints but none verifies (nothing is moved).
        """
        step, problems = newest_verified(self._directory, self.all_steps())
        if step is None:
            if not problems:
                return None
            said = "; ".join(f"step {s}: {p}" for s, p in problems)
            raise CheckpointError(
                f"no checkpoint in {self._directory} verifies ({said}); move them away to start "
                f"over, or use a new run_dir"
            )
        if not problems:
            return step
        _barrier("hopperjax: checkpoints verified")
        for bad, problem in problems:
            info(
                f"hopperjax: checkpoint step {bad} is damaged: {problem}; moved to "
                f"{DAMAGED}/ and resuming from step {step}"
            )
            if self._primary:
                target = self._directory.parent / DAMAGED / str(bad)
                n = 1
                while target.exists():
                    target = target.with_name(f"{bad}.{n}")
                    n += 1
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(self._directory / str(bad), target)
        _barrier("hopperjax: damaged checkpoints moved")
        self._manager.reload()
        return step

    def save(self, step: int, state: Any, data_state: Any, *, force: bool = False) -> bool:
        """Starts saving if ``step`` is due (or ``force``); returns whether it did.

        Raises:
          FloatingPointError: the state holds a NaN or Inf (nothing is written).
          CheckpointError: the directory has less free space than the state's size, or an
            earlier save failed.
        """
        self.poll()
        # The cadence is decided here: orbax's own interval logic also saves the first step.
        if not (force or step % self._every == 0) or step == self._manager.latest_step():
            return False
        if not bool(_all_finite(state)):
            with contextlib.suppress(CheckpointError):
                self.wait()  # a save in flight may still become the last good one
            raise FloatingPointError(
                f"the train state at step {step} holds NaN or Inf and was not checkpointed; "
                f"{self.describe_last_good()}"
            )
        needed = _state_bytes(state)
        free = shutil.disk_usage(self._directory).free
        if free < needed:
            raise CheckpointError(self._no_space(step, needed, free))
        self._pending.append((step, needed))
        try:
            return self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeSave(state), data=IteratorStateSave(data_state)
                ),
                force=True,
            )
        except Exception as e:  # orbax re-raises an earlier async save's error here, any type
            raise self._failed(e) from e

    def _failed(self, error: Exception) -> CheckpointError:
        """The one-line error for a save that failed. Saves of the same batch that did finish
        get their manifests; temporary directories are removed."""
        pending, self._pending = self._pending, []
        done = [(s, n) for s, n in pending if (self._directory / str(s)).is_dir()]
        failed = [(s, n) for s, n in pending if (s, n) not in done]
        self._start_manifests(done)
        for tmp in self._directory.glob("*.orbax-checkpoint-tmp*"):
            shutil.rmtree(tmp, ignore_errors=True)
        step, needed = failed[0] if failed else pending[-1] if pending else (None, 0)
        free = shutil.disk_usage(self._directory).free
        text = str(error)
        known = _OS_ERRORS.search(text)
        reason = getattr(error, "strerror", None) or (known.group(0) if known else text[:200])
        for future in self._manifests:
            with contextlib.suppress(OSError):  # a full disk: that step stays unverified
                future.result()
        self._manifests = []
        return CheckpointError(
            f"cannot write checkpoint step {step} to {self._directory}: {reason} (a checkpoint "
            f"needs up to {needed / 2**20:,.1f} MiB; {free / 2**20:,.1f} MiB are free); "
            f"{self.describe_last_good()}"
        )

    def _hash_committed(self) -> None:
        """orbax's post-finalization callback, run once a save's files are all written and just
        before its temporary directory is renamed into place: the manifest written into it then
        appears with the checkpoint, atomically (no window in which a kill leaves a committed
        checkpoint without one). The files orbax rewrites at the commit are added afterwards."""
        if self._primary:
            for step, _ in list(self._pending):
                for tmp in self._directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                    if tmp.is_dir() and not (tmp / MANIFEST).is_file():
                        write_manifest(tmp, skip=_COMMIT_FILES)

    def _start_manifests(self, saved: list[tuple[int, int]]) -> None:
        if self._primary:
            for step, _ in saved:
                step_dir = self._directory / str(step)
                if step_dir.is_dir():  # extends the manifest committed with it, if any
                    extend = functools.partial(write_manifest, extend=True)
                    self._manifests.append(self._hashing.submit(extend, step_dir))

    def _no_space(self, step: int, needed: int, free: int) -> str:
        return (
            f"cannot write checkpoint step {step} to {self._directory}: it needs up to "
            f"{needed / 2**20:,.1f} MiB and {free / 2**20:,.1f} MiB are free"
        )

    def poll(self) -> None:
        """Cheap, at every step: once the background save is done, checks it worked and starts
        its manifest.

        Raises:
          CheckpointError: a save failed (its temporary directory is removed).
        """
        if self._pending and not self._manager.is_saving_in_progress():
            self._finish()
        for future in [f for f in self._manifests if f.done()]:
            self._manifests.remove(future)
            future.result()

    def _finish(self) -> None:
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # orbax re-raises the writer thread's error, of any type
            raise self._failed(e) from e
        pending, self._pending = self._pending, []
        self._start_manifests(pending)

    def state_leaves(self, step: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{dotted path: (shape, dtype name)}`` of every array of the train state saved at
        ``step``, read from the checkpoint's metadata (no array is read)."""
        tree = self._manager.item_metadata(step)["state"]
        tree = getattr(tree, "tree", tree)
        return {
            leaf.name: (tuple(leaf.shape), str(leaf.dtype))
            for leaf in jax.tree.leaves(tree)
            if hasattr(leaf, "shape")
        }

    def restore_subtrees(self, step: int, abstract: dict[str, Any]) -> dict[str, Any]:
        """Restores only the state fields named by ``abstract`` (e.g. ``{"params": ...}``),
        straight into the shardings its ``jax.ShapeDtypeStruct`` leaves carry; nothing else of
        the state (optimizer state, ...) is read."""
        restore_args = _restore_args(abstract)
        directory = epath.Path(self._manager.directory) / str(step) / "state"
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
            return checkpointer.restore(
                directory,
                args=ocp.args.PyTreeRestore(
                    item=abstract, restore_args=restore_args, partial_restore=True
                ),
            )

    def restore(self, step: int, abstract_state: Any, *, partial: bool = False) -> tuple[Any, Any]:
        """Restores ``step`` straight into the shardings carried by ``abstract_state``.

        ``partial``: ``abstract_state`` may leave out arrays the checkpoint holds (a field set to
        None); those are not read.

        Returns:
          (train state, data iterator state)

        Raises:
          CheckpointError: the checkpoint was written by another number of processes (each
            process restores its own data-iterator position, which another count cannot map).
        """
        self._check_process_count(step)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item=abstract_state,
                    restore_args=_restore_args(abstract_state),
                    partial_restore=partial,
                ),
                data=IteratorStateRestore(),
            ),
        )
        return restored["state"], restored["data"]

    def _check_process_count(self, step: int) -> None:
        data_dir = self._directory / str(step) / "data"
        counts = {p.stem.rsplit("-of-", 1)[-1] for p in data_dir.glob("process_*-of-*.json")}
        here = str(jax.process_count())
        if counts and here not in counts:
            written = ", ".join(sorted(counts))
            raise CheckpointError(
                f"checkpoint step {step} in {self._directory} was written by {written} "
                f"process(es) and this run has {here}: each process resumes its own data "
                f"position, so resume with {written} process(es), or start a new run_dir "
                f"(hopperjax.restore_params reads the parameters on any process count)"
            )

    def wait(self) -> None:
        """Blocks until every started save is on disk with its manifest.

        Raises:
          CheckpointError: a save failed.
        """
        self._finish()
        for future in self._manifests:
            future.result()
        self._manifests = []

    def close(self) -> None:
        """Waits for started saves (quietly: a failure was or will be reported by ``wait``)."""
        with contextlib.suppress(CheckpointError):
            self._finish()
        self._hashing.shutdown(wait=True)
        self._manager.close()
