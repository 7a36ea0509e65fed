"""Profiler windows, trace summaries and hardware telemetry (fake NVML; no GPU needed)."""

import gzip
import importlib.util
import json
import subprocess
import sys
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hopperjax.observe import (
    GpuMonitor,
    ProfileSummaryError,
    ProfileWindow,
    device_memory_stats,
    step_annotation,
    summarize_trace,
    trace_summary,
)
from hopperjax.observe import profile as profile_lib

# Summaries are sums and differences of float microseconds: equal up to rounding.
EXACT = 1e-12


def _load_cli():
    spec = importlib.util.spec_from_file_location(
        "profile_summary", REPO / "tools/profile_summary.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- a real capture on CPU ---------------------------------------------------------------------


def test_profile_window_captures_a_trace_that_summarizes(tmp_path):
    mesh = Mesh(np.array(jax.devices()), ("data",))
    x = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, PartitionSpec("data")))
    w = jnp.full((32, 32), 0.01)

    @jax.jit
    def step(x, w):
        with jax.named_scope("layer0"):
            for _ in range(3):
                x = jnp.tanh(x @ w)
        return x, x.sum()  # The sum over the sharded batch makes an all-reduce.

    step(x, w)  # Compile outside the window, as the loop does.
    window = ProfileWindow(tmp_path / "profile", start_step=1, num_steps=2)
    for s in range(5):
        window.before_step(s)
        assert window.active == (s in (1, 2))
        with step_annotation(s):
            out = step(x, w)
        window.after_step(s, out)
    assert window.done and not window.active
    window.close()

    files = [p.name for p in (tmp_path / "profile").rglob("*") if p.is_file()]
    assert any(f.endswith(".xplane.pb") for f in files), files
    assert any(f.endswith(".trace.json.gz") for f in files), files
    if profile_lib._HAS_PERFETTO_TRACE:
        assert "perfetto_trace.json.gz" in files

    summary = summarize_trace(tmp_path / "profile")
    assert summary["num_devices"] == 8
    assert summary["top_ops"]
    assert all(op["total_ms"] > 0 and op["count"] > 0 for op in summary["top_ops"])
    assert any(op["kind"] == "communication" for op in summary["top_ops"])
    fractions = summary["compute_frac"] + summary["communication_frac"] + summary["idle_frac"]
    assert fractions == pytest.approx(1.0, abs=1e-6)
    assert summary["compute_ms"] > 0

    proc = subprocess.run(
        [sys.executable, "tools/profile_summary.py", str(tmp_path / "profile"), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["top_ops"] == json.loads(json.dumps(summary["top_ops"]))


# --- summaries of hand-written traces ----------------------------------------------------------


def _meta(pid, name, tid=None):
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _op(pid, tid, name, ts, dur, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}


def _write_trace(path, events):
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump({"displayTimeUnit": "ns", "metadata": {}, "traceEvents": events}, f)


def test_summary_of_a_gpu_style_trace(tmp_path):
    events = [
        _meta(1, "/device:GPU:0"),
        _meta(1, "Stream #13(Compute)", tid=13),
        _meta(1, "Stream #20(Nccl)", tid=20),
        _meta(1, "XLA Ops", tid=999),
        _meta(2, "/device:GPU:1"),
        _meta(2, "Stream #13(Compute)", tid=13),
        _meta(100, "/host:CPU"),
        _meta(100, "python", tid=5),
        # Host: two steps over [0, 80) µs; the host's own events are not ops.
        _op(100, 5, "train", 0, 50, step_num="0"),
        _op(100, 5, "train", 50, 30, step_num="1"),
        _op(100, 5, "PjitFunction(step)", 0, 40),
        # GPU 0: compute [10, 30) and [50, 80); an all-reduce [25, 40) overlapping the first.
        _op(1, 13, "fusion.1", 10, 20, hlo_op="fusion.1"),
        _op(1, 20, "all-reduce.1", 25, 15, hlo_op="all-reduce-start.1"),
        _op(1, 13, "fusion.2", 50, 30, hlo_op="fusion.2"),
        _op(1, 999, "fusion.1", 0, 100),  # A derived line repeating the streams: ignored.
        # GPU 1: compute [60, 100), past the host's last step.
        _op(2, 13, "fusion.1", 60, 40, hlo_op="fusion.1"),
    ]
    _write_trace(tmp_path / "plugins/profile/run/host.trace.json.gz", events)
    s = summarize_trace(tmp_path)

    assert s["num_devices"] == 2
    assert s["window_ms"] == pytest.approx(0.100, abs=EXACT)  # [0, 100) µs
    # GPU 0: compute 50, exposed comm 10 (5 hidden), idle 40; GPU 1: compute 40, idle 60 (µs).
    by_device = {d["device"]: d for d in s["devices"]}
    assert by_device["/device:GPU:0"]["compute_ms"] == pytest.approx(0.050, abs=EXACT)
    assert by_device["/device:GPU:0"]["communication_ms"] == pytest.approx(0.010, abs=EXACT)
    assert by_device["/device:GPU:0"]["idle_ms"] == pytest.approx(0.040, abs=EXACT)
    assert by_device["/device:GPU:1"]["idle_ms"] == pytest.approx(0.060, abs=EXACT)
    assert s["compute_ms"] == pytest.approx(0.045, abs=EXACT)
    assert s["communication_ms"] == pytest.approx(0.005, abs=EXACT)
    assert s["idle_ms"] == pytest.approx(0.050, abs=EXACT)
    assert s["hidden_communication_ms"] == pytest.approx(0.0025, abs=EXACT)
    assert s["compute_frac"] + s["communication_frac"] + s["idle_frac"] == pytest.approx(1.0)

    assert s["op_time_ms"] == pytest.approx(0.105, abs=EXACT)
    top = [(o["name"], o["kind"], o["count"], round(o["total_ms"] * 1e3, 9)) for o in s["top_ops"]]
    assert top == [
        ("fusion.1", "compute", 2, 60.0),
        ("fusion.2", "compute", 1, 30.0),
        ("all-reduce.1", "communication", 1, 15.0),
    ]
    assert s["top_ops"][0]["pct"] == pytest.approx(100 * 60 / 105)
    assert "fusion.1" in trace_summary.format_summary(s)


def test_summary_of_a_cpu_style_trace_uses_self_times(tmp_path):
    events = [
        _meta(7, "/host:CPU"),
        _meta(7, "python", tid=1),
        _meta(7, "tf_XLAPjRtCpuClient/1", tid=2),
        _op(7, 1, "PjitFunction(step)", 0, 500),  # No hlo_op, no step_num: neither op nor window.
        # Device 0: a while loop [100, 150) around its body [110, 130).
        _op(7, 2, "while.1", 100, 50, hlo_op="while.1", device_ordinal="0"),
        _op(7, 2, "fusion", 110, 20, hlo_op="fusion", device_ordinal="0"),
        _op(7, 2, "end: fusion", 130, 0.5),
        # Device 1, same worker thread: an all-reduce [120, 160).
        _op(7, 2, "all-reduce", 120, 40, hlo_op="all-reduce", device_ordinal="1"),
    ]
    _write_trace(tmp_path / "a/b/vm.trace.json.gz", events)
    s = summarize_trace(tmp_path)

    assert s["num_devices"] == 2
    assert s["window_ms"] == pytest.approx(0.060, abs=EXACT)  # first op to last op: [100, 160)
    assert s["compute_ms"] == pytest.approx(0.025, abs=EXACT)  # (50 + 0) / 2
    assert s["communication_ms"] == pytest.approx(0.020, abs=EXACT)  # (0 + 40) / 2
    assert s["idle_ms"] == pytest.approx(0.015, abs=EXACT)  # (10 + 20) / 2
    totals = {o["name"]: o["total_ms"] * 1e3 for o in s["top_ops"]}
    assert totals == pytest.approx({"all-reduce": 40.0, "while.1": 30.0, "fusion": 20.0})


def test_a_cpu_op_that_runs_async_lasts_until_its_end_marker(tmp_path):
    """An Eigen convolution's event covers its dispatch only; its ``end:`` marker says when its
    work finished. The ops its thread ran meanwhile are not nested in it; a synchronous op keeps
    the marker inside its own event, also where another device runs an op of the same name; a
    loop is never extended (its body's ops are its work)."""
    events = [
        _meta(7, "/host:CPU"),
        _meta(7, "tf_XLAPjRtCpuClient/1", tid=2),
        _meta(8, "/host:CPU other"),
        _op(7, 2, "convolution.1", 100, 2, hlo_op="convolution.1", device_ordinal="0"),
        _op(7, 2, "fusion.1", 105, 15, hlo_op="fusion.1", device_ordinal="0"),
        # The same op on device 1 (another thread, started first), synchronous too: markers
        # inside each event (taken in order of start, device 0's op would get device 1's).
        _op(7, 4, "fusion.1", 104, 22, hlo_op="fusion.1", device_ordinal="1"),
        _op(7, 2, "end: fusion.1", 119, 0.2),
        _op(7, 4, "end: fusion.1", 125, 0.2),
        _op(8, 2, "end: convolution.1", 150, 0.2),  # another process's marker: not this op's
        _op(7, 3, "end: convolution.1", 180, 0.2),  # on a pool thread, 78 µs after dispatch
        _op(7, 2, "convolution.1", 200, 10, hlo_op="convolution.1", device_ordinal="0"),
        _op(7, 2, "end: convolution.1", 209, 0.2),  # the second run: no wait
        _op(7, 2, "while.2", 220, 5, hlo_op="while.2", device_ordinal="0"),
        _op(7, 2, "end: while.2", 260, 0.2),
    ]
    _write_trace(tmp_path / "vm.trace.json.gz", events)
    s = summarize_trace(tmp_path, top=5)

    assert s["window_ms"] == pytest.approx(0.125, abs=EXACT)  # [100, 225)
    by_device = {d["device"].rsplit(" ", 1)[-1]: d for d in s["devices"]}
    # device 0: [100, 180), [200, 210), [220, 225); device 1: [104, 126)
    assert by_device["0"]["compute_ms"] == pytest.approx(0.095, abs=EXACT)
    assert by_device["1"]["compute_ms"] == pytest.approx(0.022, abs=EXACT)
    totals = {o["name"]: round(o["total_ms"] * 1e3, 6) for o in s["top_ops"]}
    assert totals == {"convolution.1": 90.0, "fusion.1": 37.0, "while.2": 5.0}
    assert {o["name"]: o["to_end_marker"] for o in s["top_ops"]} == {
        "convolution.1": 1,
        "fusion.1": 0,
        "while.2": 0,
    }
    # Three worker threads (2, 4, and 3, which completes the convolution): never more ops at
    # once than that, so each op's share is its self time.
    assert {o["name"]: round(o["share_ms"] * 1e3, 6) for o in s["top_ops"]} == totals
    assert s["op_share_ms"] == pytest.approx(s["op_time_ms"], abs=EXACT)
    text = trace_summary.format_summary(s)
    assert "convolution.1*" in text and "fusion.1*" not in text
    assert "the span from dispatch to its end marker" in text and "share ms" not in text


def test_async_ops_queued_on_a_busy_pool_are_ranked_by_their_share_of_its_threads(tmp_path):
    """Four copies dispatched at once on a one-thread pool finish one after another: their spans
    (40 + 49 + 58 + 67 µs) include their waits in the queue and overlap, 214 µs in a 70 µs stretch
    of one thread. Shared fairly while they wait, they are the 70 µs the thread had; the
    synchronous fusion after them (80 µs) is the larger op."""
    events = [_meta(7, "/host:CPU")]
    for k in range(4):
        events.append(_op(7, 2, "copy.1", k, 1, hlo_op="copy.1", device_ordinal="0"))
        events.append(_op(7, 2, "end: copy.1", 40 + 10 * k, 0.1))
    events += [
        _op(7, 2, "fusion.1", 70, 80, hlo_op="fusion.1", device_ordinal="0"),
        _op(7, 2, "end: fusion.1", 149.5, 0.1),
    ]
    _write_trace(tmp_path / "vm.trace.json.gz", events)
    s = summarize_trace(tmp_path, top=5)
    assert [o["name"] for o in s["top_ops"]] == ["fusion.1", "copy.1"]
    copy, fusion = s["top_ops"][1], s["top_ops"][0]
    assert copy["total_ms"] * 1e3 == pytest.approx(214.0) and copy["to_end_marker"] == 4
    assert copy["share_ms"] * 1e3 == pytest.approx(70.0)
    assert fusion["share_ms"] * 1e3 == pytest.approx(80.0) == fusion["total_ms"] * 1e3
    assert fusion["pct"] == pytest.approx(100 * 80 / 150)
    assert s["op_share_ms"] == pytest.approx(0.150) and s["op_time_ms"] == pytest.approx(0.294)
    assert s["compute_frac"] == pytest.approx(1.0)  # [0, 150) busy: the split is unchanged
    text = trace_summary.format_summary(s)
    assert "by their share of the worker threads (of 0.150 ms; spans 0.294 ms" in text
    assert "share ms" in text


def test_worker_threads_are_those_holding_a_real_part_of_a_process_s_op_events():
    """A client thread that runs one op inline among hundreds is not a worker; a pool thread
    holding only the end markers of the async ops it completed is; processes are counted apart."""
    events = [_op(7, 2, "fusion.1", t, 1, hlo_op="fusion.1") for t in range(200)]
    events += [_op(7, 3, "end: copy.1", t, 0.1) for t in range(50)]
    events += [_op(7, 5, "copy.2", 0, 1, hlo_op="copy.2")]  # 1 of 251: under 1 %
    events += [_op(7, 1, "PjitFunction(step)", 0, 300)]  # neither an op nor a marker
    events += [_op(8, 2, "fusion.1", 0, 1, hlo_op="fusion.1")]
    assert trace_summary._worker_threads(events) == {7: 2, 8: 1}


def test_end_markers_of_back_to_back_ops_and_of_rounding_stay_with_their_ops(tmp_path):
    """Two runs of one op back to back on a thread (a marker at the second's start is the
    first's), and a synchronous op whose marker falls a rounding step past its event while
    another device's op of that name runs async: nothing is extended but the async op."""
    events = [
        _meta(7, "/host:CPU"),
        _op(7, 2, "fusion.1", 100, 10, hlo_op="fusion.1", device_ordinal="0"),
        _op(7, 2, "fusion.1", 110, 10, hlo_op="fusion.1", device_ordinal="0"),
        _op(7, 2, "end: fusion.1", 110, 0.1),
        _op(7, 2, "end: fusion.1", 120, 0.1),
        _op(7, 4, "copy.1", 100, 1, hlo_op="copy.1", device_ordinal="1"),  # async: ends at 200
        _op(7, 2, "copy.1", 125, 5, hlo_op="copy.1", device_ordinal="0"),
        _op(7, 2, "end: copy.1", 130.004, 0.1),  # rounding: device 0's own
        _op(7, 9, "end: copy.1", 200, 0.1),
    ]
    _write_trace(tmp_path / "vm.trace.json.gz", events)
    s = summarize_trace(tmp_path, top=5)
    totals = {o["name"]: round(o["total_ms"] * 1e3, 6) for o in s["top_ops"]}
    assert totals == {"copy.1": 105.0, "fusion.1": 20.0}
    assert {o["name"]: o["to_end_marker"] for o in s["top_ops"]} == {"copy.1": 1, "fusion.1": 0}


@pytest.mark.parametrize(
    "name, comm",
    [
        ("all-reduce-start.3", True),
        ("ncclDevKernel_AllGather_RING_LL", True),
        ("reduce-scatter.1", True),
        ("all-to-all.6", True),
        ("collective-permute-done", True),
        ("psum", True),
        ("send-done.2", True),
        ("fusion.12", False),
        ("small_reduce_fusion", False),
        ("loop_gather_fusion", False),
        ("sender_copy", False),
    ],
)
def test_collective_names(name, comm):
    assert bool(trace_summary._COLLECTIVE.search(name)) is comm


def test_trace_without_ops_is_a_clear_error(tmp_path, capsys):
    events = [_meta(7, "/host:CPU"), _meta(7, "python", tid=1), _op(7, 1, "f", 0, 10)]
    _write_trace(tmp_path / "vm.trace.json.gz", events)
    with pytest.raises(ProfileSummaryError, match="no XLA op events"):
        summarize_trace(tmp_path)
    cli = _load_cli()
    assert cli.main([str(tmp_path)]) == 1
    assert "no XLA op events" in capsys.readouterr().err
    assert cli.main([str(tmp_path / "missing")]) == 1
    assert "no *.trace.json.gz" in capsys.readouterr().err


# --- ProfileWindow edge cases ------------------------------------------------------------------


def test_profile_window_close_never_raises(tmp_path):
    never = ProfileWindow(tmp_path / "never", start_step=3, num_steps=2)
    never.close()
    never.close()
    assert not never.done and not (tmp_path / "never").exists()

    for off in (
        ProfileWindow(tmp_path / "off", start_step=0, num_steps=2, enabled=False),
        ProfileWindow(tmp_path / "off", start_step=0, num_steps=0),
    ):
        off.before_step(0)
        assert not off.active

    window = ProfileWindow(tmp_path / "twice", start_step=0, num_steps=1)
    window.before_step(0)
    jax.profiler.stop_trace()  # Someone else stops the process-wide trace first.
    window.after_step(0, jnp.ones(2))
    window.close()
    window.close()
    assert window.done and not window.active


def test_step_annotation_adds_an_nvtx_range_when_nvtx_imports(monkeypatch):
    entered = []

    class FakeRange:
        def __init__(self, message):
            self.message = message

        def __enter__(self):
            entered.append(self.message)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(profile_lib, "_nvtx", types.SimpleNamespace(annotate=FakeRange))
    with step_annotation(3):
        pass
    assert entered == ["step 3"]
    monkeypatch.setattr(profile_lib, "_nvtx", None)
    with step_annotation(4):
        pass


# --- hardware telemetry ------------------------------------------------------------------------


class FakeNvmlError(Exception):
    pass


def _fake_pynvml(num_gpus=2):
    """A pynvml stand-in whose readings the test sets (``util``, ``mem``, ``temp``, ``power``)."""
    nvml = types.ModuleType("pynvml")
    nvml.NVML_TEMPERATURE_GPU = 0
    nvml.util = [10] * num_gpus
    nvml.mem = [2**30] * num_gpus
    nvml.temp = [60] * num_gpus
    nvml.power = [100_000] * num_gpus  # mW
    nvml.samples = 0
    nvml.shutdowns = 0
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetCount = lambda: num_gpus
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i

    def utilization(h):
        nvml.samples += h == 0
        return types.SimpleNamespace(gpu=nvml.util[h])

    def power(h):
        if nvml.power[h] is None:
            raise FakeNvmlError("Not Supported")
        return nvml.power[h]

    def shutdown():
        nvml.shutdowns += 1

    nvml.nvmlDeviceGetUtilizationRates = utilization
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=nvml.mem[h])
    nvml.nvmlDeviceGetTemperature = lambda h, sensor: nvml.temp[h]
    nvml.nvmlDeviceGetPowerUsage = power
    nvml.nvmlShutdown = shutdown
    return nvml


def test_gpu_monitor_without_pynvml_is_quiet(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # Makes `import pynvml` raise ImportError.
    logs = []
    monitor = GpuMonitor(0.01, log=logs.append)
    monitor.start()
    assert not monitor.available and not monitor.running
    assert "pynvml is not installed" in monitor.reason
    assert monitor.snapshot() == {}
    monitor.close()
    assert len(logs) == 1 and monitor.reason in logs[0]


def test_gpu_monitor_when_nvml_init_fails(monkeypatch):
    nvml = _fake_pynvml()

    def fail():
        raise FakeNvmlError("NVML Shared Library Not Found")

    nvml.nvmlInit = fail
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    logs = []
    monitor = GpuMonitor(log=logs.append)
    assert not monitor.available
    assert "NVML Shared Library Not Found" in monitor.reason
    assert monitor.snapshot() == {}
    assert len(logs) == 1


def test_gpu_monitor_averages_samples_since_the_last_snapshot(monkeypatch):
    nvml = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    logs = []
    monitor = GpuMonitor(3600.0, log=logs.append)
    assert monitor.available and logs == []
    nvml.power[1] = None  # GPU 1 has no power sensor: its other readings still count.
    for util, mem_gib, temp, power_mw in [
        (10, 2, 60, 100_000),
        (20, 4, 70, 200_000),
        (30, 3, 80, 0),
    ]:
        nvml.util[0], nvml.mem[0], nvml.temp[0], nvml.power[0] = (
            util,
            mem_gib * 2**30,
            temp,
            power_mw,
        )
        monitor.sample()
    assert monitor.snapshot() == {
        "gpu0_util_pct": 20.0,
        "gpu0_mem_used_gib": 3.0,
        "gpu0_temp_c": 70.0,
        "gpu0_power_w": 100.0,
        "gpu1_util_pct": 10.0,
        "gpu1_mem_used_gib": 1.0,
        "gpu1_temp_c": 60.0,
    }
    # Nothing sampled since: the snapshot takes one sample of the current readings.
    assert monitor.snapshot()["gpu0_util_pct"] == 30.0
    monitor.close()
    assert nvml.shutdowns == 1


def test_gpu_monitor_thread_samples_and_close_joins_it(monkeypatch):
    nvml = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monitor = GpuMonitor(0.001, log=pytest.fail)
    monitor.start()
    assert monitor.running
    deadline = time.monotonic() + 10
    while nvml.samples < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert nvml.samples >= 3
    assert monitor.snapshot()["gpu1_power_w"] == 100.0
    monitor.close()
    assert not monitor.running
    assert "hopperjax-gpu-monitor" not in [t.name for t in threading.enumerate()]
    monitor.close()
    assert nvml.shutdowns == 1
    assert monitor.snapshot() == {}


def test_device_memory_stats(monkeypatch):
    assert device_memory_stats() == {}  # CPU devices keep no allocator counters.
    gib = 2**30
    devices = [
        types.SimpleNamespace(
            memory_stats=lambda: {
                "bytes_in_use": gib,
                "peak_bytes_in_use": 2 * gib,
                "bytes_limit": 4 * gib,
            }
        ),
        types.SimpleNamespace(memory_stats=lambda: None),
    ]
    monkeypatch.setattr(jax, "local_devices", lambda: devices)
    assert device_memory_stats() == {
        "dev0_bytes_in_use_gib": 1.0,
        "dev0_peak_bytes_in_use_gib": 2.0,
        "dev0_bytes_limit_gib": 4.0,
    }


def test_each_precision_is_measured_against_its_own_peak():
    """The README's promise: fp32 (true fp32 GEMMs) against the fp32 peak, tf32 against TF32."""
    from types import SimpleNamespace

    from hopperjax.observe.flops import peak_tflops
    from hopperjax.precision import PEAK_DTYPE

    h100 = SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")
    assert peak_tflops(h100, PEAK_DTYPE["fp32"]) == (66.9, "datasheet H100 SXM fp32")
    assert peak_tflops(h100, PEAK_DTYPE["tf32"]) == (494.7, "datasheet H100 SXM tf32")
    assert peak_tflops(h100, PEAK_DTYPE["bf16"])[0] == 989.4


def test_tensorboard_tags_are_grouped():
    from hopperjax.observe.metrics import tb_tag

    assert tb_tag("loss") == "train/loss"
    assert tb_tag("grad_norm") == "train/grad_norm"
    assert tb_tag("eval_loss") == "eval/loss"
    assert tb_tag("eval_accuracy") == "eval/accuracy"
    assert tb_tag("tokens_per_s") == "perf/tokens_per_s"
    assert tb_tag("mfu") == "perf/mfu"
    assert tb_tag("gpu0_util_pct") == "gpu/gpu0_util_pct"
    assert tb_tag("dev0_peak_bytes_in_use_gib") == "gpu/dev0_peak_bytes_in_use_gib"


def test_forced_color_in_a_log_file_gets_no_live_display(monkeypatch):
    import io

    from rich.console import Console

    from hopperjax.observe import metrics

    assert not metrics.is_live(Console(file=io.StringIO()))
    monkeypatch.setattr("sys.stdout", io.StringIO())  # FORCE_COLOR: rich calls it a terminal
    assert not metrics.is_live(Console(force_terminal=True))


def test_cpu_peak_is_measured_once_per_machine(tmp_path, monkeypatch):
    import jax

    from hopperjax.observe import flops

    monkeypatch.setenv("HOPPERJAX_CACHE_DIR", str(tmp_path))
    first, source = flops.peak_tflops(jax.devices()[0], "fp32")
    assert source == "measured fp32 matmul now, cached" and first > 0
    cache = json.loads((tmp_path / "peaks.json").read_text())
    (entry,) = cache.values()
    entry["tflops"] = 123.0  # a later run reads the kept figure, never measures again
    (tmp_path / "peaks.json").write_text(json.dumps(cache))
    again, source = flops.peak_tflops(jax.devices()[0], "fp32")
    assert again == 123.0 and source.endswith(", cached")
    (tmp_path / "peaks.json").write_text("{not json")  # a damaged file: measured again
    assert flops.peak_tflops(jax.devices()[0], "fp32")[1] == "measured fp32 matmul now, cached"
    cache = json.loads((tmp_path / "peaks.json").read_text())
    for bad in (0, -1.0, True, "fast"):  # never a divisor of zero, a bool or a string
        (tmp_path / "peaks.json").write_text(json.dumps({k: {"tflops": bad} for k in cache}))
        assert flops.peak_tflops(jax.devices()[0], "fp32")[1].startswith("measured fp32 matmul now")
    monkeypatch.delenv("HOPPERJAX_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(flops.Path, "home", lambda: (_ for _ in ()).throw(RuntimeError("no home")))
    assert flops.peak_tflops(jax.devices()[0], "fp32")[1] == "measured fp32 matmul, not cached"


def test_end_of_run_summary_and_plots(tmp_path):
    import matplotlib

    from hopperjax.observe import summary

    records = [
        {"step": 0, "eval_loss": float("nan"), "eval_pairs": 500.0},
        {"step": 0, "loss": 3.0},
        {"step": 1, "loss": 2.5},
        {"step": 2, "eval_loss": 2.4, "eval_accuracy": 0.3, "eval_pairs": 500.0},
        {"step": 2, "loss": 2.2},
        {"step": 4, "eval_loss": 2.6, "eval_accuracy": 0.35, "eval_bleu": 30.5},
    ]
    backend = matplotlib.get_backend()
    written = summary.write_plots(tmp_path, records)
    assert matplotlib.get_backend() == backend  # a notebook's backend is left alone
    assert [p.name for p in written] == ["loss.png", "eval.png"]
    assert all(p.stat().st_size > 1000 for p in written)
    assert summary._score_keys([r for r in records if "eval_loss" in r]) == [
        "eval_accuracy",
        "eval_bleu",  # on some evals only (generation metrics), still plotted; counts are not
    ]
    lines = summary.summary_lines(tmp_path, records, [2, 4], ["python -m hopperjax.sample ..."])
    assert lines[0] == (
        "hopperjax: done at step 3 | last train loss 2.2000 | best eval loss 2.4000 at step 2"
    )
    stopped = summary.summary_lines(tmp_path, records, [2], [], total_steps=10)
    assert stopped[0].startswith("hopperjax: stopped at step 3 of 10 |")
    many = summary.summary_lines(tmp_path, records, [2], [], single_device=False)
    assert not any("hopperjax.inspect" in line for line in many)
    assert f"  checkpoints: {tmp_path / 'checkpoints'} (steps 2, 4)" in lines
    nexts = lines[lines.index("  next:") + 1 :]
    assert nexts[0] == "    python -m hopperjax.sample ..."
    assert any(c.strip().startswith("tensorboard --logdir") for c in nexts)


@pytest.fixture
def terminal(monkeypatch):
    """A fake 120-column terminal the metrics writer animates; returns what it was shown."""
    import io

    from rich.console import Console

    from hopperjax.observe import metrics

    screen = io.StringIO()
    monkeypatch.setattr(
        metrics,
        "make_console",
        lambda: Console(file=screen, force_terminal=True, width=120, highlight=False),
    )
    monkeypatch.setattr(metrics, "is_live", lambda console: True)
    return screen


def test_a_terminal_gets_a_live_progress_bar(tmp_path, terminal):
    from hopperjax.observe import metrics

    writer = metrics.MetricsWriter(tmp_path, total_steps=10, examples_name="tokens")
    assert writer._progress is None  # nothing live before the first record
    for step in (4, 9):
        writer.write({"step": step, "loss": 2.5, "lr": 1e-3, "step_time_s": 0.1,
                      "tokens_per_s": 1000.0, "eta_s": 65.0})  # fmt: skip
    writer.close()
    shown = terminal.getvalue()
    assert "10/10" in shown and "1,000 tokens/s | eta 0:01:05" in shown  # redrawn on a timer
    assert "step       5/10 | loss 2.5000" in shown  # the plain lines still print above it


def test_bar_mode_shows_the_bar_and_a_line_at_each_end_but_no_step_lines(tmp_path, terminal):
    """``train(console="bar")``, what the experiments use for their many runs."""
    from hopperjax.observe import metrics

    writer = metrics.MetricsWriter(
        tmp_path / "run{seed}[b]", total_steps=10, console=False, bar=True
    )
    writer.info("not shown")
    writer.write({"step": 9, "loss": 2.5, "lr": 1e-3, "step_time_s": 0.1})
    writer.close()
    shown = terminal.getvalue()
    # The bar, labelled with the run's folder name as plain text (not markup, not a format).
    assert "run{seed}[b]" in shown and "10/10" in shown and "loss 2.5000" in shown
    assert "step " not in shown and "not shown" not in shown


def test_summary_says_which_extra_brings_plots_and_tensorboard(tmp_path, monkeypatch):
    import importlib.util

    from hopperjax.observe import summary

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("matplotlib", "tensorboard") else real(name, *a),
    )
    records = [{"step": 0, "loss": 2.0}]
    lines = summary.summary_lines(tmp_path, records, [], [])
    viz = "the viz extra: pip install -e '.[viz]'"
    assert f"  plots:       none without matplotlib ({viz})" in lines
    assert any(line.endswith(f"/tb   # {viz}") for line in lines)


def test_tensorboard_counts_updates_done_like_the_console(tmp_path):
    """Train record s (update s) at s + 1 on TensorBoard's axis, beside the eval made after it."""
    from hopperjax.observe import metrics

    writer = metrics.MetricsWriter(tmp_path, total_steps=10, console=False)
    seen = []
    writer._tb.add_scalar = lambda tag, value, step: seen.append((tag, step))
    writer.write({"step": 9, "loss": 2.5, "lr": 1e-3, "step_time_s": 0.1})
    writer.write({"step": 10, "eval_loss": 2.4})
    writer.close()
    assert ("train/loss", 10) in seen and ("eval/loss", 10) in seen
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["step"] == 9
