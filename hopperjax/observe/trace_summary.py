"""Summarizes a ``jax.profiler`` trace: top ops, and the window split into compute/comm/idle.

Reads the Chrome trace-event JSON (``<host>.trace.json.gz``) that ``jax.profiler`` writes beside
the ``xplane.pb``; no TensorBoard or XProf install is needed. Only complete events (``"ph": "X"``,
``ts`` and ``dur`` in microseconds) are used; process and thread names come from the ``"M"``
metadata events. XProf emits no begin/end (``B``/``E``) pairs, so those are ignored.

Which events are XLA ops (the heuristic, checked against traces of JAX 0.10):

- GPU/TPU: each device is a process named ``/device:GPU:0`` (``/device:TPU:0``, ...). On GPU its
  threads are ``Stream #N(...)`` lines holding kernels and copies, plus lines XProf derives from
  them (``XLA Ops``, ``XLA Modules``, ``Steps``, ``Framework Name Scope``, ...) that repeat the
  same time. We take the ``Stream*`` threads; failing those, the ``XLA Ops`` thread (TPU); failing
  that, every thread but the derived ones. One device process is one device.
- CPU: there is no device process. The XLA CPU runtime runs ops on the PjRt client's worker
  threads (named ``tf_XLAPjRtCpuClient/<id>``) inside the ``/host:CPU`` process; each op event
  carries ``args.hlo_op``, ``args.hlo_module`` and ``args.device_ordinal``. We take every event with
  an ``hlo_op`` arg (which leaves out executor waits) and group them into devices by
  ``device_ordinal``; one worker thread serves several devices. The runtime marks each op's
  completion with an ``end: <op>`` event; an op that runs asynchronously (an Eigen convolution, a
  copy, a fusion split across the thread pool) has an event as long as its dispatch only, and
  its work lasts until that marker, so its end is taken from the marker (``_until_end_markers``
  says how markers are paired with ops): without this, a convolution net's step showed two thirds
  idle on CPU. Such an op's time is then its span from dispatch to completion, which includes
  any wait for a free pool thread: the compute/idle split counts the pool's work, and its own
  total can overstate it (ops overlap, so op time can exceed the window). So on CPU the top ops
  are ranked by each op's share of the process's worker threads (``_pool_shares``): while n ops
  run at once on P worker threads (``_worker_threads``), n > P, each gets P / n of that time.

An op is communication when its name or ``hlo_op`` looks like a collective (all-reduce,
all-gather, reduce-scatter, all-to-all, collective-permute, send/recv, NCCL kernels, psum); all
other ops, copies included, are compute. On CPU a collective's time includes waiting for the
slowest participant, as a GPU's NCCL kernel's does.

The window is the traced steps: from the first ``StepTraceAnnotation`` (events with a
``step_num`` arg) to the later of the last step's end and the last op's end; without step markers
it is the first op's start to the last op's end. Per device, over the window:
compute = union of compute ops; communication = the part of the union of collectives that no
compute op overlaps (exposed communication; the hidden part is reported separately);
idle = window - union of all ops. The three sum to the window; the summary averages them over
devices. Op totals are self times (nested ops, e.g. a scan's body inside its ``while``, are
subtracted from the enclosing op) summed over devices.
"""

from __future__ import annotations

import bisect
import collections
import gzip
import json
import re
from pathlib import Path
from typing import Any, NamedTuple

# Lookarounds keep "small_reduce_fusion" and "sender" out; NCCL kernels ("ncclDevKernel_...")
# match by their prefix.
_COLLECTIVE = re.compile(
    r"(?<![a-z])(all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|all[-_]?to[-_]?all|"
    r"collective[-_]?(permute|broadcast)|ppermute|psum|(send|recv)(?![a-z]))|nccl",
    re.IGNORECASE,
)
# Lines XProf derives from the stream lines; counting them too would count time twice.
_DERIVED_THREADS = (
    "XLA Ops",
    "XLA Modules",
    "Steps",
    "Framework Ops",
    "Framework Name Scope",
    "Source code",
    "TensorFlow Ops",
    "XLA TraceMe",
)
_TRACE_SUFFIXES = (".trace.json.gz", ".trace.json")


class ProfileSummaryError(ValueError):
    """No trace file, or a trace without the op events a summary needs."""


class _Op(NamedTuple):
    name: str
    start: float  # µs
    end: float  # µs
    device: tuple[int, int]  # (pid, device ordinal or -1): one device's timeline
    thread: tuple[int, int]  # (pid, tid): where ops nest (an async op's own: tid < 0)
    comm: bool


def find_trace(trace_dir: str | Path) -> Path:
    """The newest ``*.trace.json.gz`` / ``*.trace.json`` under ``trace_dir`` (or that file)."""
    path = Path(trace_dir)
    if path.is_file():
        return path
    found = [p for p in path.rglob("*") if p.name.endswith(_TRACE_SUFFIXES)]
    if not found:
        raise ProfileSummaryError(f"no *.trace.json.gz or *.trace.json under {path}")
    return max(found, key=lambda p: p.stat().st_mtime)


def _load_events(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") if path.name.endswith(".gz") else path.open() as f:
        data = json.load(f)
    # The format allows a bare event array as well as {"traceEvents": [...]}.
    return data["traceEvents"] if isinstance(data, dict) else data


def _select_ops(events: list[dict[str, Any]]) -> tuple[list[_Op], dict[tuple[int, int], str]]:
    """The XLA op events (module docstring) and a display name per device."""
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[e["pid"], e["tid"]] = e["args"]["name"]
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]

    chosen: dict[int, set[int] | None] = {}  # device pid -> op threads (None: all of them)
    for pid, name in procs.items():
        if not name.startswith("/device:"):
            continue
        named = {tid: n for (p, tid), n in threads.items() if p == pid}
        streams = {t for t, n in named.items() if n.startswith("Stream")}
        xla_ops = {t for t, n in named.items() if n == "XLA Ops"}
        rest = {t for t, n in named.items() if n not in _DERIVED_THREADS}
        chosen[pid] = (streams or xla_ops or rest) if named else None

    ops, names = [], {}
    for e in complete:
        args = e.get("args") or {}
        pid, tid = e.get("pid", 0), e.get("tid", 0)
        if pid in chosen:
            if chosen[pid] is not None and tid not in chosen[pid]:
                continue
            device = (pid, -1)
            names[device] = procs[pid]
        elif not chosen and "hlo_op" in args:
            ordinal = int(args.get("device_ordinal", -1))
            device = (pid, ordinal)
            names[device] = f"{procs.get(pid, pid)} device {ordinal}"
        else:
            continue
        comm = bool(_COLLECTIVE.search(e["name"]) or _COLLECTIVE.search(args.get("hlo_op", "")))
        start = float(e["ts"])
        ops.append(_Op(e["name"], start, start + float(e["dur"]), device, (pid, tid), comm))
    if not chosen:
        ops = _until_end_markers(ops, complete)
    return ops, names


_END = "end: "
# Ops whose work is the ops of the computations they call, traced on their own.
_CONTROL_FLOW = re.compile(r"^(while|conditional|call)(\.|$)")


# A synchronous op's marker can fall a rounding step past its event's end (XProf writes ``ts`` and
# ``dur`` apart, each rounded to the nanosecond).
_MARKER_SLACK_US = 0.05


def _until_end_markers(ops: list[_Op], events: list[dict[str, Any]]) -> list[_Op]:
    """CPU ops extended to their ``end: <op>`` completion markers where those come later (async
    ops; module docstring). An op takes the last marker of its name on its own thread that falls
    inside its event (it ran synchronously); the other markers go, in order, to the earliest
    unpaired op of that name in that process that started before them. An extended op gets a
    thread of its own, so that the ops its thread ran meanwhile are not counted as nested inside
    it. Control flow (``while``, ``conditional``, ``call``) is never extended: its work is its
    body's ops."""
    markers = sorted(
        (float(e["ts"]), e.get("pid", 0), e.get("tid", 0), e["name"][len(_END) :])
        for e in events
        if e["name"].startswith(_END) and "hlo_op" not in (e.get("args") or {})
    )
    same_thread: dict[tuple[int, int, str], list[int]] = collections.defaultdict(list)
    for i in sorted(range(len(ops)), key=lambda i: ops[i].start):
        same_thread[(*ops[i].thread, ops[i].name)].append(i)
    starts = {key: [ops[i].start for i in idx] for key, idx in same_thread.items()}
    inside: dict[int, tuple[float, int, str]] = {}  # op -> the marker inside its event
    leftover = []
    for ts, pid, tid, name in markers:
        key = (pid, tid, name)
        # The op that started last strictly before the marker (a marker cannot open its op).
        k = bisect.bisect_left(starts.get(key, []), ts) - 1
        i = same_thread[key][k] if k >= 0 else None
        if i is not None and ts <= ops[i].end + _MARKER_SLACK_US:
            if i in inside:
                leftover.append(inside[i])  # an earlier marker inside it was another op's
            inside[i] = (ts, pid, name)
        else:
            leftover.append((ts, pid, name))
    leftover.sort()
    waiting: dict[tuple[int, str], collections.deque[int]] = collections.defaultdict(
        collections.deque
    )
    order = [
        i
        for i in sorted(range(len(ops)), key=lambda i: ops[i].start)
        if i not in inside and not _CONTROL_FLOW.match(ops[i].name)
    ]
    out, k = list(ops), 0
    for ts, pid, name in leftover:
        while k < len(order) and ops[order[k]].start <= ts:
            waiting[ops[order[k]].thread[0], ops[order[k]].name].append(order[k])
            k += 1
        queue = waiting.get((pid, name))
        if queue:
            i = queue.popleft()
            if ts > ops[i].end + _MARKER_SLACK_US:
                out[i] = ops[i]._replace(end=ts, thread=(ops[i].thread[0], -1 - i))
    return out


def _union_length(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals``, clipped to ``[lo, hi]``."""
    total, reach = 0.0, lo
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            total += end - start
            reach = end
    return total


def _self_segments(ops: list[_Op]) -> list[list[tuple[float, float]]]:
    """Where each op runs itself: its interval less the ops nested inside it (same thread, same
    device)."""
    holes: list[list[tuple[float, float]]] = [[] for _ in ops]
    by_thread = collections.defaultdict(list)
    for i, op in enumerate(ops):
        by_thread[op.thread, op.device].append(i)
    for indices in by_thread.values():
        indices.sort(key=lambda i: (ops[i].start, -ops[i].end))  # Parents before children.
        stack: list[int] = []
        for i in indices:
            while stack and ops[i].start >= ops[stack[-1]].end:
                stack.pop()
            if stack:
                parent = ops[stack[-1]]
                holes[stack[-1]].append((ops[i].start, min(ops[i].end, parent.end)))
            stack.append(i)
    segments = []
    for op, cut in zip(ops, holes, strict=True):
        mine, at = [], op.start
        for start, end in sorted(cut):
            if start > at:
                mine.append((at, start))
            at = max(at, end)
        if op.end > at:
            mine.append((at, op.end))
        segments.append(mine)
    return segments


# A thread counts as one of its process's workers when it holds at least this share of the
# process's op events and end markers: XLA:CPU's client threads run a few ops inline (~10 of
# ~8,000 in one measured trace) but do not add a core's worth of work.
_WORKER_MIN_FRACTION = 0.01


def _worker_threads(events: list[dict[str, Any]]) -> dict[int, int]:
    """Per process, how many threads do its ops' work (P of ``_pool_shares``): those holding at
    least ``_WORKER_MIN_FRACTION`` of its op events and ``end:`` markers (a pool thread that
    only completes async ops has markers alone)."""
    held = collections.Counter(
        (e.get("pid", 0), e.get("tid", 0))
        for e in events
        if e.get("ph") == "X"
        and ("hlo_op" in (e.get("args") or {}) or str(e.get("name", "")).startswith(_END))
    )
    per_process = collections.Counter()
    for (pid, _), count in held.items():
        per_process[pid] += count
    pool = collections.Counter()
    for (pid, _), count in held.items():
        pool[pid] += count >= _WORKER_MIN_FRACTION * per_process[pid]
    return dict(pool)


def _pool_shares(
    ops: list[_Op], segments: list[list[tuple[float, float]]], pool: dict[int, int]
) -> list[float]:
    """Each CPU op's share of its process's worker threads (µs): while more ops run than the
    process has workers (``pool``, P: ``_worker_threads``), each of the n gets P / n of the time,
    as if the threads were shared fairly; else all of it. An async op's span (dispatch to end
    marker) includes its waits for a free thread, so with many in flight the spans overlap far
    past what P threads can do; the shares never sum to more than P x the window. A synchronous
    op is cut too while queued async ops outnumber the threads (its thread's time is shared)."""
    shares = [0.0] * len(ops)
    for pid in {op.thread[0] for op in ops}:
        threads = max(pool.get(pid, 0), 1)
        mine = [i for i, op in enumerate(ops) if op.thread[0] == pid]
        edges = sorted(
            (t, step)
            for i in mine
            for start, end in segments[i]
            for t, step in ((start, 1), (end, -1))
        )
        # rate(t) = min(1, P / n(t)); at each edge time, the integral of the rate so far.
        integral: dict[float, float] = {}
        total, active, last = 0.0, 0, None
        for t, step in edges:
            if last is not None and active:
                total += (t - last) * min(1.0, threads / active)
            integral[t] = total
            active += step
            last = t
        for i in mine:
            shares[i] = sum(integral[end] - integral[start] for start, end in segments[i])
    return shares


def summarize_trace(trace_dir: str | Path, top: int = 15) -> dict[str, Any]:
    """Top ops and the compute/communication/idle split of the newest trace under a directory.

    Args:
      trace_dir: a profile directory (searched recursively) or a trace file.
      top: how many ops to list.

    Returns:
      A JSON-able dict: ``trace_file``; ``num_devices``; ``window_ms``; per-device averages
      ``compute_ms``, ``communication_ms`` (exposed), ``idle_ms`` and their ``*_frac`` (summing
      to 1), ``hidden_communication_ms``; ``devices`` (the split per device); ``op_time_ms`` (all
      op self time, all devices); ``op_share_ms`` (the same as the worker threads' shares: on
      CPU, ``_pool_shares``; elsewhere equal); ``top_ops``: ``[{name, kind, count, total_ms,
      share_ms, pct, to_end_marker}]``, ranked by ``share_ms``, where ``pct`` is the share of
      ``op_share_ms`` and ``to_end_marker`` counts the calls timed from dispatch to their
      ``end:`` marker (async CPU ops; their ``total_ms`` includes any wait for a pool thread).

    Raises:
      ProfileSummaryError: no trace file, or no XLA op events in it.
    """
    path = find_trace(trace_dir)
    events = _load_events(path)
    ops, names = _select_ops(events)
    cpu = not any(name.startswith("/device:") for name in names.values())
    if not ops:
        raise ProfileSummaryError(
            f"{path} holds no XLA op events (no /device:* process with op threads, and no "
            f"host events with an hlo_op arg); was anything run on the device while tracing?"
        )
    steps = [e for e in events if e.get("ph") == "X" and "step_num" in (e.get("args") or {})]
    lo = min(float(e["ts"]) for e in steps) if steps else min(op.start for op in ops)
    hi = max([op.end for op in ops] + [float(e["ts"]) + float(e["dur"]) for e in steps])
    window = hi - lo
    if window <= 0:
        raise ProfileSummaryError(f"{path}: the traced window has no length")

    by_device = collections.defaultdict(list)
    for op in ops:
        by_device[op.device].append(op)
    devices = []
    for device, mine in sorted(by_device.items()):
        compute = _union_length([(o.start, o.end) for o in mine if not o.comm], lo, hi)
        comm = _union_length([(o.start, o.end) for o in mine if o.comm], lo, hi)
        busy = _union_length([(o.start, o.end) for o in mine], lo, hi)
        devices.append(
            {
                "device": names[device],
                "compute_ms": compute / 1e3,
                "communication_ms": (busy - compute) / 1e3,
                "idle_ms": (window - busy) / 1e3,
                # Clamped: the difference of two float sums can come out as -1e-17.
                "hidden_communication_ms": max(comm - (busy - compute), 0.0) / 1e3,
            }
        )

    summary: dict[str, Any] = {
        "trace_file": str(path),
        "num_devices": len(devices),
        "window_ms": window / 1e3,
    }
    for key in ("compute_ms", "communication_ms", "idle_ms", "hidden_communication_ms"):
        summary[key] = sum(d[key] for d in devices) / len(devices)
    for key in ("compute", "communication", "idle"):
        summary[f"{key}_frac"] = summary[f"{key}_ms"] / summary["window_ms"]
    summary["devices"] = devices

    segments = _self_segments(ops)
    selfs = [sum(end - start for start, end in mine) for mine in segments]
    # CPU traces only: a GPU's ops are its streams' kernels, which run as their events say.
    shares = _pool_shares(ops, segments, _worker_threads(events)) if cpu else selfs
    # name -> [count, self µs, pool share µs, comm, calls timed to markers]
    totals: dict[str, list[Any]] = {}
    for op, self_us, share_us in zip(ops, selfs, shares, strict=True):
        entry = totals.setdefault(op.name, [0, 0.0, 0.0, op.comm, 0])
        entry[0] += 1
        entry[1] += self_us
        entry[2] += share_us
        entry[4] += op.thread[1] < 0  # extended to its end marker (_until_end_markers)
    op_time = sum(t[1] for t in totals.values())
    op_share = sum(t[2] for t in totals.values())
    summary["op_time_ms"] = op_time / 1e3
    summary["op_share_ms"] = op_share / 1e3
    ranked = sorted(totals.items(), key=lambda kv: (-kv[1][2], -kv[1][1]))[:top]
    summary["top_ops"] = [
        {
            "name": name,
            "kind": "communication" if comm else "compute",
            "count": count,
            "total_ms": self_us / 1e3,
            "share_ms": share_us / 1e3,
            "pct": 100.0 * share_us / op_share if op_share > 0 else 0.0,
            "to_end_marker": to_marker,
        }
        for name, (count, self_us, share_us, comm, to_marker) in ranked
    ]
    return summary


def format_summary(summary: dict[str, Any], *, name_width: int = 60) -> str:
    """A readable table of ``summarize_trace``'s result."""
    window = summary["window_ms"]
    lines = [
        f"trace: {summary['trace_file']}",
        f"window: {window:.3f} ms, {summary['num_devices']} device(s), split averaged over them",
    ]
    for key in ("compute", "communication", "idle"):
        lines.append(
            f"  {key:<14} {summary[f'{key}_ms']:>10.3f} ms {100 * summary[f'{key}_frac']:6.1f}%"
        )
    lines.append(
        f"  (communication hidden under compute: {summary['hidden_communication_ms']:.3f} ms)"
    )
    if summary["num_devices"] > 1:
        lines += ["", f"  {'device':<30} {'compute ms':>11} {'comm ms':>10} {'idle ms':>10}"]
        for d in summary["devices"]:
            lines.append(
                f"  {d['device'][:30]:<30} {d['compute_ms']:>11.3f} "
                f"{d['communication_ms']:>10.3f} {d['idle_ms']:>10.3f}"
            )
    marked = any(op.get("to_end_marker") for op in summary["top_ops"])
    share = summary.get("op_share_ms", summary["op_time_ms"])
    shared = share < summary["op_time_ms"] * (1 - 1e-9)  # more ops at once than threads
    lines += [
        "",
        f"top {len(summary['top_ops'])} ops by "
        + (
            f"their share of the worker threads (of {share:.3f} ms; spans "
            f"{summary['op_time_ms']:.3f} ms, all devices):"
            if shared
            else f"self time (of {summary['op_time_ms']:.3f} ms op time, all devices):"
        ),
        f"  {'name':<{name_width}} {'kind':<6} {'count':>6} {'total ms':>10}"
        + (f" {'share ms':>10}" if shared else "")
        + f" {'%':>6}",
    ]
    for op in summary["top_ops"]:
        mark = "*" if op.get("to_end_marker") else ""
        width = name_width - len(mark)
        name = op["name"] if len(op["name"]) <= width else op["name"][: width - 1] + "…"
        name += mark
        kind = "comm" if op["kind"] == "communication" else "comp"
        lines.append(
            f"  {name:<{name_width}} {kind:<6} {op['count']:>6d} {op['total_ms']:>10.3f}"
            + (f" {op.get('share_ms', op['total_ms']):>10.3f}" if shared else "")
            + f" {op['pct']:>5.1f}%"
        )
    if marked:
        lines.append(
            "  * ran asynchronously (CPU): total is the span from dispatch to its end marker, "
            "waits for a free thread included"
        )
    if shared:
        lines.append(
            "  share: the time divided among the ops running at once where there were more "
            "than the process's worker threads (% of the shares)"
        )
    return "\n".join(lines)
