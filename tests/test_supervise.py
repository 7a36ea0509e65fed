"""The multi-process supervisor: JAX's native abort on a lost peer becomes one line (exit 3).

The end-to-end case (a real two-process job losing a process) is in test_multiprocess; here a
stand-in child prints what JAX prints and aborts, which is quick and exact.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

from conftest import REPO

from hopperjax import supervise

# What JAX 0.10 printed in this repository's two-process test (stack dumps trimmed).
ABORTS = REPO / "tests" / "golden" / "jax_aborts"
HEARTBEAT_ABORT = (ABORTS / "heartbeat.txt").read_text()
COORDINATOR_ABORT = (ABORTS / "coordinator.txt").read_text()
GLOO_ABORT = (ABORTS / "gloo.txt").read_text()
OTHER_SERVICE_ABORT = (
    "F1204 06:51:26.235376   20745 client.h:80] Terminating process because the JAX distributed "
    "service detected fatal errors. absl::Status: INTERNAL: barrier timed out\n"
)
RESTART = "this process stopped too; restart every process to resume from the newest checkpoint"


def _explain(text):
    return supervise.explain_abort(text, coordinator="10.0.0.1:1234", heartbeat_timeout_s=30)


def test_each_known_abort_is_explained_in_one_line_naming_what_was_lost():
    assert _explain(HEARTBEAT_ABORT) == (
        "lost process 1 of the job (no heartbeat for distributed.heartbeat_timeout_s=30 s); "
        + RESTART
    )
    # Several lost tasks, printed in the coordination service's long form.
    several = HEARTBEAT_ABORT.replace(
        "heartbeats):\n1\n", "heartbeats):\n/job:jax_worker/task:2\n/job:jax_worker/task:5\n"
    )
    assert _explain(several).startswith("lost processes 2, 5 of the job")
    assert _explain(COORDINATOR_ABORT) == (
        "lost the coordinator (process 0 at distributed.coordinator_address=10.0.0.1:1234); "
        + RESTART
    )
    assert _explain(GLOO_ABORT) == (
        "a collective with the other processes failed (gloo: op.preamble.length <= op.nbytes. "
        "1024 vs 768. Received data size doesn't match expected size. Is there a distributed "
        "collective mismatch in your code?), most likely because a peer process was lost; "
        + RESTART
    )
    assert _explain(OTHER_SERVICE_ABORT) == (
        "JAX's distributed service stopped this process (INTERNAL: barrier timed out); " + RESTART
    )
    assert _explain("Segmentation fault\n") is None
    assert _explain("E1204 06:51:26.235367   20745 x.cc:1] some error\n") is None


def _child_script(tmp_path, body):
    script = tmp_path / "child.py"
    script.write_text("import os, signal, sys, time\n" + textwrap.dedent(body))
    return [sys.executable, str(script)]


def _supervise_in_a_process(tmp_path, child):
    """The supervisor as the CLI runs it: its own process (signals go to its main thread)."""
    runner = (
        "import sys; from hopperjax import supervise; "
        f"sys.exit(supervise.run({child!r}, coordinator='h:1', heartbeat_timeout_s=30))"
    )
    return subprocess.Popen(
        [sys.executable, "-c", runner],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def test_a_heartbeat_abort_becomes_one_line_and_other_output_passes_through(tmp_path):
    child = _child_script(
        tmp_path,
        f"""
        print("step 1", flush=True)
        sys.stderr.write("a warning of our own\\n"); sys.stderr.flush()
        sys.stderr.write({HEARTBEAT_ABORT!r}); sys.stderr.flush()
        os.abort()
        """,
    )
    proc = _supervise_in_a_process(tmp_path, child)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == supervise.EXIT_LOST_PEER, err
    assert out == "step 1\n"
    assert err.splitlines() == [
        "a warning of our own",
        "hopperjax: lost process 1 of the job (no heartbeat for "
        "distributed.heartbeat_timeout_s=30 s); " + RESTART,
    ]


def test_held_native_records_are_passed_on_and_other_aborts_verbatim(tmp_path, monkeypatch):
    monkeypatch.setattr(supervise, "HOLD_S", 0.1)
    record = "E1204 06:51:26.235367   20745 x.cc:1] a harmless native error\n"
    child = _child_script(
        tmp_path,
        f"""
        sys.stderr.write({record!r} + "its second line\\n"); sys.stderr.flush()
        time.sleep(0.5)
        sys.stderr.write("F1204 06:51:27.000000   20745 y.cc:2] Check failed: x\\n*** dump\\n")
        sys.stderr.flush()
        os.abort()
        """,
    )
    from io import StringIO

    said = StringIO()
    code = supervise.run(child, coordinator="h:1", heartbeat_timeout_s=30, say=said)
    assert code == 128 + signal.SIGABRT
    assert said.getvalue() == (
        record + "its second line\n" + "F1204 06:51:27.000000   20745 y.cc:2] Check failed: x\n"
        "*** dump\n"
    )
    # A clean exit's status passes through; so does a non-abort failure's.
    assert (
        supervise.run(
            _child_script(tmp_path, "sys.exit(2)"),
            coordinator="h:1",
            heartbeat_timeout_s=30,
            say=StringIO(),
        )
        == 2
    )


def test_sigterm_is_forwarded_and_a_killed_supervisor_takes_its_child_with_it(tmp_path):
    marker = tmp_path / "child.pid"
    child = _child_script(
        tmp_path,
        f"""
        def stop(*args):
            print("child got SIGTERM", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        open({str(marker)!r}, "w").write(str(os.getpid()))
        while True:
            time.sleep(0.05)
        """,
    )
    proc = _supervise_in_a_process(tmp_path, child)
    deadline = time.monotonic() + 30
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert (proc.returncode, out) == (0, "child got SIGTERM\n")

    marker.unlink()
    proc = _supervise_in_a_process(tmp_path, child)
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    child_pid = int(marker.read_text())
    proc.kill()
    proc.wait()
    for _ in range(100):
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(child_pid, signal.SIGKILL)
        raise AssertionError("the child outlived its SIGKILLed supervisor")
