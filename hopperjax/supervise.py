"""A thin supervisor for one process of a multi-process job: a lost peer is one line, not an abort.

When a peer stops sending heartbeats (or the coordinator goes away), JAX's distributed client ends
the process from a C++ thread: a fatal log record, a native stack dump and SIGABRT. Python cannot
catch that in the process itself, so the CLI runs a multi-process job's training in a child
process and reads the child's stderr on the way through: everything is passed on as it comes,
except records in the C++ log format (``E1204 06:50:59.399959 20595 file.cc:1549] ...``), which
are held for ``HOLD_S`` seconds. Held records are passed on unless a fatal record follows. When
the child then dies of JAX's distributed service (which names the lost process, or the lost
coordinator), or of a CPU collective (gloo) that broke first, its abort is reported as one line
(exit ``EXIT_LOST_PEER``) and the dump is dropped. Any other abort is passed on verbatim.

Signals: SIGTERM to the supervisor is passed to the child (a container's PID 1 gets it alone);
SIGINT is ignored here, since a terminal's Ctrl-C reaches the child through the process group.

Standard library only: the supervisor never touches a device.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

# Set in the child's environment: the process that trains, not the one that watches.
SUPERVISED_ENV = "HOPPERJAX_SUPERVISED"
# Exit status when a peer process (or the coordinator) was lost: restart every process to resume.
EXIT_LOST_PEER = 3
# How long a C++ log record waits for a fatal record that would make it part of an abort.
HOLD_S = 2.0

_NATIVE_RECORD = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+\s+\S+:\d+\]")
# A fatal C++ log record, or an uncaught C++ exception (gloo's, when a CPU collective loses a peer).
_FATAL_START = re.compile(r"^(F\d{4} |terminate called after throwing)")
_SERVICE_ABORT = "the JAX distributed service detected fatal errors"
_UNHEALTHY = re.compile(r"stopped sending heartbeats\):\s*\n(.*?)\n\s*The tasks have", re.S)
_LEADER_LOST = ("Failed to send RPC to coordination service", "leader task was preempted")
_GLOO_ABORT = re.compile(
    r"terminate called after throwing an instance of 'gloo::\w+'\s*\n\s*what\(\):\s*(.*)"
)


def is_supervised_child() -> bool:
    return os.environ.get(SUPERVISED_ENV) == "1"


def explain_abort(text: str, *, coordinator: str, heartbeat_timeout_s: int) -> str | None:
    """One line for an abort of this process caused by the job losing a process: JAX's
    distributed service (which names the lost process or the coordinator), or a cross-process
    collective on CPU hosts (gloo) that failed first and cannot name it. None for other text."""
    restart = "this process stopped too; restart every process to resume from the newest checkpoint"
    if _SERVICE_ABORT not in text:
        gloo = _GLOO_ABORT.search(text)
        if gloo is None:
            return None
        # gloo reports the broken stream, e.g. a short read, with an "enforce fail at" location.
        what = re.sub(r"\[enforce fail at [^\]]*\]\s*", "", gloo.group(1)).strip()
        return (
            f"a collective with the other processes failed (gloo: {what[:160]}), most likely "
            f"because a peer process was lost; {restart}"
        )
    unhealthy = _UNHEALTHY.search(text)
    if unhealthy:
        # One task per line, printed as an index or as '/job:.../task:N': the last number is it.
        lost = [m.group(1) for m in re.finditer(r"(\d+)\s*$", unhealthy.group(1), re.M)]
        which = f"process {lost[0]}" if len(lost) == 1 else f"processes {', '.join(lost)}"
        return (
            f"lost {which} of the job (no heartbeat for distributed.heartbeat_timeout_s="
            f"{heartbeat_timeout_s} s); {restart}"
        )
    if any(marker in text for marker in _LEADER_LOST):
        return (
            f"lost the coordinator (process 0 at distributed.coordinator_address={coordinator}); "
            f"{restart}"
        )
    status = text.split("absl::Status:", 1)[-1].strip().splitlines()
    reason = status[0].strip() if status else "unknown reason"
    return f"JAX's distributed service stopped this process ({reason}); {restart}"


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL it when the supervisor dies (even by SIGKILL), so a
    killed supervisor never leaves a training process behind. Linux only; elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _read_lines(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def run(
    command: Sequence[str],
    *,
    coordinator: str,
    heartbeat_timeout_s: int,
    say: IO[str] | None = None,
) -> int:
    """Runs ``command`` (the training CLI) as a supervised child; returns the exit status.

    The child's stdout is its own; its stderr passes through ``say`` (default ``sys.stderr``) as
    described in the module docstring.
    """
    say = say or sys.stderr
    env = dict(os.environ, **{SUPERVISED_ENV: "1"})
    child = subprocess.Popen(
        list(command),
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        env=env,
        preexec_fn=_die_with_parent,
    )
    assert child.stderr is not None
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=_read_lines, args=(child.stderr, lines), daemon=True)
    reader.start()

    def forward_term(signum: int, frame: object) -> None:
        child.send_signal(signum)

    on_main = threading.current_thread() is threading.main_thread()
    previous = {}
    if on_main:
        previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, forward_term)
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    held: list[str] = []
    held_since = 0.0
    fatal = False
    try:
        while True:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                line = ""
            if line is None:
                break
            if line:
                fatal = fatal or bool(_FATAL_START.match(line))
                if fatal or held or _NATIVE_RECORD.match(line):
                    held_since = held_since if held else time.monotonic()
                    held.append(line)
                else:
                    say.write(line)
                    say.flush()
            if held and not fatal and time.monotonic() - held_since > HOLD_S:
                say.write("".join(held))
                say.flush()
                held.clear()
        returncode = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if child.poll() is None:
            child.kill()
    text = "".join(held)
    line = explain_abort(text, coordinator=coordinator, heartbeat_timeout_s=heartbeat_timeout_s)
    if fatal and line and returncode != 0:
        say.write(f"hopperjax: {line}\n")
        say.flush()
        return EXIT_LOST_PEER
    say.write(text)
    say.flush()
    return _exit_status(returncode)
