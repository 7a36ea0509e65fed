"""An HTTP JSON endpoint for an exported artifact, with dynamic batching.

Requests wait in a bounded queue; one worker takes the oldest, adds more while they fit in
``max_batch`` examples and the oldest has waited less than ``max_wait_ms``, concatenates them,
pads the batch with zero rows to the next bucket size (the artifact's module is shape-polymorphic,
but every new batch size compiles once: buckets bound the compiles), runs it on a worker thread
and hands each request its own rows. Every bucket is compiled at start-up, before the server
answers, so no request waits for a compile. An artifact whose rows are not independent (DTA:
pairs index into the batch's molecule tables; ``metadata.json``'s ``independent_rows``) runs one
request at a time, padded the same way.

Endpoints: ``POST /predict`` with ``{"inputs": {field: nested list}}`` (a leading batch
dimension on every field the artifact's signature says) returns ``{"outputs": ...}`` (NaN and
infinities as null); a malformed request gets 400 with a one-line message, a full queue 503.
Ids beyond a table or vocabulary are not checked (the artifact has no bounds): a table-wise DLRM
would read a neighbouring table's row. ``GET /health`` says what is served; ``GET /metrics``
counts requests, examples, batches, rejections and latencies.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import time
from typing import Any

import jax
import numpy as np

from hopperjax.infer import artifact as artifact_lib


class QueueFull(Exception):
    """The request queue is at its bound (the HTTP layer answers 503)."""


@dataclasses.dataclass
class _Request:
    batch: dict[str, np.ndarray]
    rows: int
    future: asyncio.Future
    arrived: float


def buckets_up_to(max_batch: int) -> tuple[int, ...]:
    """Powers of two below ``max_batch``, and ``max_batch`` itself."""
    sizes, n = [], 1
    while n < max_batch:
        sizes.append(n)
        n *= 2
    return (*sizes, max_batch)


class Batcher:
    """Dynamic batching in front of a loaded artifact (call ``start`` inside the event loop)."""

    def __init__(
        self,
        model: artifact_lib.Artifact,
        *,
        max_batch: int = 32,
        max_wait_ms: float = 5.0,
        max_queue: int = 256,
        buckets: tuple[int, ...] | None = None,
    ):
        if max_batch < 1 or max_queue < 1 or max_wait_ms < 0:
            raise ValueError("max_batch and max_queue must be >= 1 and max_wait_ms >= 0")
        self.model = model
        self.max_batch, self.max_wait = max_batch, max_wait_ms / 1e3
        self.max_queue = max_queue
        self.buckets = tuple(sorted(buckets or buckets_up_to(max_batch)))
        self.independent = bool(model.metadata.get("independent_rows", True))
        self.batch_fields = [k for k, v in model.inputs.items() if v["shape"][:1] == ["batch"]]
        self.queue: asyncio.Queue[_Request] | None = None
        self.carry: _Request | None = None
        self.counts = collections.Counter()
        self.latencies: collections.deque[float] = collections.deque(maxlen=10_000)
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=10_000)
        # One thread: the device runs one batch at a time; the event loop stays free meanwhile.
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.queue = asyncio.Queue(maxsize=self.max_queue)
        self.task = asyncio.get_running_loop().create_task(self._work())

    def warm_up(self) -> None:
        """Runs every bucket once on zeros, so no request waits for a compile."""
        for size in self.buckets:
            zeros = {
                name: np.zeros([size if n == "batch" else n for n in spec["shape"]], spec["dtype"])
                for name, spec in self.model.inputs.items()
            }
            self._run(zeros)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def rows_of(self, batch: dict[str, np.ndarray]) -> int:
        return int(batch[self.batch_fields[0]].shape[0]) if self.batch_fields else 1

    async def submit(self, batch: dict[str, Any]) -> Any:
        """The artifact's outputs for ``batch`` (checked: raises ArtifactError naming the field,
        ValueError for more rows than ``max_batch``, QueueFull)."""
        checked = self.model.check(batch)
        rows = self.rows_of(checked)
        if rows > self.max_batch or rows < 1:
            raise ValueError(f"a request holds 1 to {self.max_batch} examples, got {rows}")
        future = asyncio.get_running_loop().create_future()
        try:
            self.queue.put_nowait(_Request(checked, rows, future, time.perf_counter()))
        except asyncio.QueueFull:
            self.counts["rejected"] += 1
            raise QueueFull(f"the queue holds {self.max_queue} requests") from None
        return await future

    async def _next(self, timeout: float | None) -> _Request | None:
        """The carried-over request, else one already queued, else one that arrives within
        ``timeout`` seconds (None: wait as long as it takes; <= 0: do not wait)."""
        if self.carry is not None:
            request, self.carry = self.carry, None
            return request
        try:
            return self.queue.get_nowait()  # (wait_for with timeout 0 never takes one)
        except asyncio.QueueEmpty:
            pass
        if timeout is None:
            return await self.queue.get()
        if timeout <= 0:
            return None
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            return None

    async def _work(self) -> None:
        while True:
            first = await self._next(None)
            group = [first]
            try:
                await self._batch(group)
            except Exception as e:  # whatever failed, every request of the batch hears why
                for r in group:
                    if not r.future.done():
                        r.future.set_exception(e)

    async def _batch(self, group: list[_Request]) -> None:
        """Fills ``group`` (its first request taken) up to ``max_batch`` rows, runs it, answers."""
        rows = group[0].rows
        deadline = group[0].arrived + self.max_wait
        while self.independent and rows < self.max_batch:
            request = await self._next(deadline - time.perf_counter())
            if request is None:
                break
            if rows + request.rows > self.max_batch:
                self.carry = request  # first in the next batch
                break
            group.append(request)
            rows += request.rows
        size = next((b for b in self.buckets if b >= rows), rows)
        merged = {}
        for name in group[0].batch:
            parts = [r.batch[name] for r in group]
            if name in self.batch_fields:
                value = np.concatenate(parts) if len(parts) > 1 else parts[0]
                pad = [(0, size - value.shape[0])] + [(0, 0)] * (value.ndim - 1)
                merged[name] = np.pad(value, pad)
            else:
                merged[name] = parts[0]
        loop = asyncio.get_running_loop()
        outputs = await loop.run_in_executor(self.executor, self._run, merged)
        start, now = 0, time.perf_counter()
        for r in group:
            part = jax.tree.map(lambda x, s=start, n=r.rows: x[s : s + n], outputs)
            start += r.rows
            if not r.future.done():
                r.future.set_result(part)
            self.latencies.append(now - r.arrived)
        self.counts["batches"] += 1
        self.counts["requests"] += len(group)
        self.counts["examples"] += rows
        self.batch_sizes.append(size)

    def _run(self, batch: dict[str, np.ndarray]) -> Any:
        return jax.tree.map(np.asarray, self.model(batch))

    def metrics(self) -> dict[str, Any]:
        lat = np.array(self.latencies) * 1e3
        return {
            "requests": self.counts["requests"],
            "examples": self.counts["examples"],
            "batches": self.counts["batches"],
            "rejected": self.counts["rejected"],
            "queued": self.queue.qsize() if self.queue is not None else 0,
            "mean_batch": float(np.mean(self.batch_sizes)) if self.batch_sizes else 0.0,
            "latency_ms_p50": float(np.percentile(lat, 50)) if lat.size else None,
            "latency_ms_p99": float(np.percentile(lat, 99)) if lat.size else None,
        }


def _array(name: str, values: Any, dtype: str) -> np.ndarray:
    """A request field as the artifact's dtype; numbers of another kind (floats for an integer
    field, strings) are refused rather than cast."""
    array = np.asarray(values)
    want = np.dtype(dtype)
    if array.dtype.kind not in "biuf" or (want.kind in "iu" and array.dtype.kind == "f"):
        raise ValueError(f"field {name!r}: expected {want.name} values, got {array.dtype.name}")
    return array.astype(want)


def _encode(outputs: Any) -> bytes:
    """``{"outputs": ...}`` as JSON; NaN and infinities (which JSON has no word for) as null."""

    def listed(x: np.ndarray) -> Any:
        x = np.asarray(x)
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            return np.where(np.isfinite(x), x, None).tolist()
        return x.tolist()

    return json.dumps({"outputs": jax.tree.map(listed, outputs)}).encode()


def build_app(model: artifact_lib.Artifact, **batching: Any) -> Any:
    """The Starlette application serving ``model``."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    batcher = Batcher(model, **batching)

    async def predict(request: Request) -> JSONResponse:
        try:
            body = json.loads(await request.body())
            inputs = body["inputs"]
            if not isinstance(inputs, dict):
                raise TypeError("'inputs' must be an object of fields")
            batch = {
                name: _array(name, inputs[name], spec["dtype"])
                for name, spec in model.inputs.items()
                if name in inputs
            }
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return JSONResponse({"error": f"the body is not JSON: {e}"}, status_code=400)
        except KeyError:
            return JSONResponse({"error": "the body needs {\"inputs\": {field: values}}"},
                                status_code=400)  # fmt: skip
        except (TypeError, ValueError, OverflowError) as e:
            return JSONResponse({"error": f"bad inputs: {e}"}, status_code=400)
        try:
            outputs = await batcher.submit(batch)
        except QueueFull as e:
            return JSONResponse({"error": f"busy: {e}"}, status_code=503)
        except (artifact_lib.ArtifactError, ValueError) as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        # Encoded off the event loop (a batch's logits are large); non-finite numbers as null.
        body = await asyncio.get_running_loop().run_in_executor(None, _encode, outputs)
        return Response(body, media_type="application/json")

    async def health(request: Request) -> JSONResponse:
        del request
        m = model.metadata
        return JSONResponse({
            "status": "ok", "workload": m["workload"], "step": m["step"],
            "quantize": m["quantize"], "inputs": m["inputs"], "max_batch": batcher.max_batch,
        })  # fmt: skip

    async def metrics(request: Request) -> JSONResponse:
        del request
        return JSONResponse(batcher.metrics())

    async def lifespan(app: Any) -> Any:
        # Compile every bucket before the first request (the server answers /health after).
        await asyncio.get_running_loop().run_in_executor(batcher.executor, batcher.warm_up)
        batcher.start()
        yield
        await batcher.stop()

    import contextlib

    app = Starlette(
        routes=[
            Route("/predict", predict, methods=["POST"]),
            Route("/health", health),
            Route("/metrics", metrics),
        ],
        lifespan=contextlib.asynccontextmanager(lifespan),
    )
    app.state.batcher = batcher
    return app
