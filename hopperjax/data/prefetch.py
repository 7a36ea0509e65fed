"""Device prefetch: global batches are assembled and transferred on a background thread.

While step ``n`` runs on the device, batch ``n + 1`` is already being copied; the host loop never
waits on input unless the pipeline is slower than the step. The host iterator state is recorded
with every batch, so ``get_state()`` names exactly what the consumer has taken: a checkpoint
resumes at the next unconsumed batch even though ``depth`` batches were read ahead.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

_DONE = object()

# cuDNN's first run of a compiled graph (XLA's fused attention on a GPU) captures a CUDA graph on
# a private stream as a warm-up. Seen on an H200 (JAX 0.11.2, CUDA 13): that capture failed with
# "capturing stream has unjoined work" in the training loop, where a prefetch thread copies
# batches to the device, and not when the same step ran with no copies in flight. So every
# prefetcher's copy is made, and finished, under this lock, and ``run_alone`` holds it over a
# compiled step's first run. Known compromise: one lock for the process (module state), since
# the copies it must exclude come from every prefetcher at once (train and eval); other device
# work on other threads (checkpoint copies, the monitor) is not covered, and the GPU check will
# say whether it needs to be.
_TRANSFERS = threading.Lock()


def run_alone(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, run to completion while no prefetcher copies anything to a device (for the
    first run of a compiled step: see ``_TRANSFERS``)."""
    with _TRANSFERS:
        out = fn(*args)
        jax.block_until_ready(out)
    return out


def to_global_batch(
    local_batch: dict[str, np.ndarray],
    sharding: Sharding | dict[str, Sharding],
    *,
    blocks: int = 1,
) -> dict[str, jax.Array]:
    """This process's rows -> one global ``jax.Array`` per field, laid out by ``sharding``.

    Args:
      local_batch: this process's block of rows, each field [rows, ...].
      sharding: one sharding for every field, or one per field.
      blocks: how many such blocks the global batch has (``process_batch_shard``); processes
        holding the same block pass the same rows.
    """
    return {
        k: jax.make_array_from_process_local_data(
            sharding[k] if isinstance(sharding, dict) else sharding,
            v,
            (v.shape[0] * blocks, *v.shape[1:]),
        )
        for k, v in local_batch.items()
    }


class DevicePrefetcher:
    """Iterator of global on-device batches, read ``depth`` ahead of the consumer.

    Args:
      iterator: a grain iterator (``get_state``/``set_state``) yielding dicts of local numpy rows.
      sharding: layout of every batch field across the mesh.
      depth: how many batches may wait on device.
      blocks: row blocks in the global batch (see ``to_global_batch``).
    """

    def __init__(self, iterator: Any, sharding: Sharding, depth: int, *, blocks: int = 1):
        self._iterator = iterator
        self._sharding = sharding
        self._blocks = blocks
        self._state = iterator.get_state()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="device-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            for local in self._iterator:
                state = self._iterator.get_state()
                with _TRANSFERS:
                    batch = to_global_batch(local, self._sharding, blocks=self._blocks)
                    jax.block_until_ready(batch)
                if not self._put((batch, state)):
                    return
            self._put(_DONE)
        except Exception as e:  # Re-raised in the consumer's thread, where it can be handled.
            self._put(e)

    def __iter__(self) -> Iterator[dict[str, jax.Array]]:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        if self._stop.is_set():
            raise RuntimeError("DevicePrefetcher is closed")
        item = self._queue.get()
        if item is _DONE or isinstance(item, Exception):
            self._queue.put(item)  # The producer has ended: later calls see the same outcome.
            if item is _DONE:
                raise StopIteration
            raise item
        batch, self._state = item
        return batch

    def get_state(self) -> Any:
        """Host iterator state after the last batch this prefetcher handed out."""
        return self._state

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
