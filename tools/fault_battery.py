"""The long fault battery: kills at random moments, damaged checkpoints, a full disk, bad inputs.

    python tools/fault_battery.py [--config configs/quickstart.yaml] [--kills 12] [--seed 0]

Every trial drives the real CLI (``python -m hopperjax.train``) on the config's workload, shrunk
with its ``smoke_overrides``, and checks the run directory afterwards against one uninterrupted
reference run:

- kills: SIGTERM, SIGKILL or SIGINT (once or twice) at a random moment (saves included: a
  checkpoint every 3 steps), then the same command again until the run is complete. Survived =
  every step's loss equals the reference's (1e-6 relative) and every checkpoint verifies.
- corruptions: a run stopped at step 12 has its newest checkpoint damaged (each kind once); the
  re-run must name it, fall back to step 9, and finish with the reference's losses.
- disk full: a tmpfs too small for the second checkpoint (only as root): exit 2, one line, no
  temporary directory, the first checkpoint verifying.
- bad inputs: exit 2 with exactly one ``hopperjax:`` line and no traceback.

It prints one line per trial and the totals; exit status 1 if any trial failed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hopperjax import workloads  # noqa: E402
from hopperjax.checkpoint import MANIFEST, verify  # noqa: E402
from hopperjax.config import all_keys, load_config  # noqa: E402
from hopperjax.observe import read_metrics  # noqa: E402

STEPS = 30
# The run every trial starts from: the config's workload shrunk (``setup`` adds its overrides).
RUN = [
    f"train.steps={STEPS}",
    "train.log_every=1",
    "train.eval_every=1000",
    "train.checkpoint_every=3",
    "train.keep_checkpoints=3",
    "optim.warmup_steps=2",
    "mesh.data=1",
]
CONFIG = "configs/quickstart.yaml"
ENV = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
}


def setup(config: str) -> None:
    """Points every trial at ``config``, shrunk with its workload's ``smoke_overrides``."""
    global CONFIG
    CONFIG = config
    workload = workloads.get(load_config(config, []).workload)
    RUN[:0] = list(workload.smoke_overrides)


def cli(run_dir: Path, *overrides: str, config: str | None = None) -> list[str]:
    command = [sys.executable, "-m", "hopperjax.train", "--config", config or CONFIG]
    return [*command, *RUN, f"run_dir={run_dir}", *overrides]


def run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def matches(run_dir: Path, reference: dict[int, float]) -> str | None:
    """What differs from the reference run, or None."""
    got = losses(run_dir)
    if sorted(got) != sorted(reference):
        return f"logged steps {sorted(set(reference) - set(got))[:5]} missing"
    for step, loss in reference.items():
        if abs(got[step] - loss) > 1e-6 * abs(loss):
            return f"step {step}: loss {got[step]} != {loss}"
    for step_dir in (run_dir / "checkpoints").iterdir():
        if step_dir.name.isdigit() and (problem := verify(step_dir)):
            return f"checkpoint {step_dir.name}: {problem}"
    return None


def finish(run_dir: Path, attempts: int = 4) -> subprocess.CompletedProcess:
    """Re-runs the command until the run is complete."""
    for _ in range(attempts):
        done = run(cli(run_dir))
        if done.returncode != 0 or "nothing to do" in done.stdout:
            return done
        if max(losses(run_dir), default=-1) == STEPS - 1:
            return done
    return done


def kill_trial(work: Path, how: str, rng: random.Random, reference, n: int) -> str | None:
    run_dir = work / f"kill-{n}"
    proc = subprocess.Popen(
        cli(run_dir), cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.jsonl").is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 1.5))  # some steps in; saves every 3 steps are often in flight
    if proc.poll() is not None:
        return f"{how}: the run ended before the signal"
    sig = {"SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL}.get(how, signal.SIGINT)
    proc.send_signal(sig)
    if how == "SIGINT twice":
        time.sleep(rng.uniform(0.0, 0.2))
        proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=300)
    expected = {"SIGKILL": (-9,), "SIGINT twice": (0, 130)}.get(how, (0,))
    if code not in expected:
        return f"{how}: exit {code}, expected {expected}"
    done = finish(run_dir)
    if done.returncode != 0:
        return f"{how}: the re-run failed: {done.stderr.strip()[-300:]}"
    problem = matches(run_dir, reference)
    return f"{how}: {problem}" if problem else None


def flip_bits(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(8):
        data[(len(data) // 2 + 97 * i) % len(data)] ^= 1
    path.write_bytes(bytes(data))


def largest(step_dir: Path) -> Path:
    return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def any_file(step_dir: Path, pattern: str) -> Path:
    return sorted(step_dir.rglob(pattern))[0]


CORRUPTIONS = {
    "bit flips in the largest array file": lambda d: flip_bits(largest(d)),
    "largest array file truncated": lambda d: largest(d).write_bytes(largest(d).read_bytes()[:9]),
    "largest array file emptied": lambda d: largest(d).write_bytes(b""),
    "largest array file deleted": lambda d: largest(d).unlink(),
    "_CHECKPOINT_METADATA deleted": lambda d: (d / "_CHECKPOINT_METADATA").unlink(),
    "_CHECKPOINT_METADATA garbled": lambda d: (d / "_CHECKPOINT_METADATA").write_text("{x"),
    "state _METADATA deleted": lambda d: any_file(d / "state", "_METADATA").unlink(),
    "state _METADATA bit flips": lambda d: flip_bits(any_file(d / "state", "_METADATA")),
    "ocdbt manifest garbled": lambda d: flip_bits(any_file(d / "state", "manifest.ocdbt")),
    "iterator state garbled": lambda d: any_file(d / "data", "*.json").write_text("{garbled"),
    "iterator state deleted": lambda d: any_file(d / "data", "*.json").unlink(),
    "manifest deleted (save never finished)": lambda d: (d / MANIFEST).unlink(),
    "manifest garbled": lambda d: (d / MANIFEST).write_text("{"),
}


def corruption_trial(work: Path, stopped: Path, kind: str, reference) -> str | None:
    run_dir = work / f"corrupt-{abs(hash(kind))}"
    shutil.copytree(stopped, run_dir)
    CORRUPTIONS[kind](run_dir / "checkpoints" / "12")
    done = run(cli(run_dir))
    if done.returncode != 0:
        return f"exit {done.returncode}: {done.stderr.strip()[-300:]}"
    if "checkpoint step 12 is damaged" not in done.stderr or "from step 9" not in done.stderr:
        return "the damaged checkpoint was not named"
    return matches(run_dir, reference)


def disk_full_trial(work: Path) -> str | None:
    mount = work / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0:
        return "skipped"
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount)]).returncode:
        return "skipped"
    try:
        run_dir = mount / "run"
        done = run(cli(run_dir, "train.keep_checkpoints=10"))
        ours = [line for line in done.stderr.splitlines() if line.startswith("hopperjax:")]
        if done.returncode != 2 or len(ours) != 1 or "Traceback" in done.stderr:
            return f"exit {done.returncode}: {done.stderr.strip()[-300:]}"
        if "cannot write checkpoint" not in ours[0]:
            return f"unexpected line: {ours[0]}"
        if list((run_dir / "checkpoints").glob("*tmp*")):
            return "a temporary directory was left behind"
        steps = [p for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
        if not steps or any(verify(p) for p in steps):
            return "no verified checkpoint is left"
        return None
    finally:
        subprocess.run(["umount", str(mount)])


BAD_OVERRIDES = [
    ["optim.base_lr=nan"],
    ["optim.weight_decay=inf"],
    ["optim.clip_norm=-inf"],
    ["optim.b1=5"],
    ["optim.b2=-1"],
    ["optim.eps=-1"],
    ["model.init_std=-5"],
    ["model.norm_eps=-1"],
    ["model.rope_theta=0"],
    ["loss_scale.factor=nan"],
    ["seed=-1"],
    ["seed=4294967296"],
    ["train.steps=2147483648"],
    ["distributed.coordinator_address=localhost"],
    ["distributed.coordinator_address=256.1.1.1:99999"],
    ["mesh.data=1", "mesh.tensor=8", "model.n_heads=4"],
    ["model={n_layrs: 1}"],
    ["trian.steps=5"],
    ["workload=no_such_workload"],
    ["data.device_prefetch=0"],
    ["data.shuffle=maybe"],
]
ALIAS_BOMB = (
    "a: &a [x,x,x,x,x,x,x,x,x]\n"
    + "".join(
        f"{n}: &{n} [{','.join([f'*{p}'] * 9)}]\n" for p, n in itertools.pairwise("abcdefghi")
    )
    + "workload: *i\n"
)
BAD_FILES = {
    "not UTF-8": "name: caf\xe9\n".encode("latin-1"),
    "duplicate key": b"train:\n  steps: 5\n  steps: 6\n",
    "alias bomb": ALIAS_BOMB.encode(),
    "not YAML": b"train: [\n",
}


def bad_input_trial(work: Path, overrides: list[str], config: str | None = None) -> str | None:
    done = run(cli(work / "bad", *overrides, **({"config": config} if config else {})))
    ours = [line for line in done.stderr.splitlines() if line.startswith("hopperjax:")]
    if done.returncode != 2 or len(ours) != 1 or "Traceback" in done.stderr:
        return f"exit {done.returncode}: {done.stderr.strip()[-300:]}"
    if len(ours[0]) > 400:
        return f"a {len(ours[0])}-character line"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=CONFIG, help="the run to torment (its workload)")
    parser.add_argument("--kills", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    setup(args.config)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fault-battery-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    totals: dict[str, list[int]] = {}
    failed = 0

    def record(group: str, name: str, problem: str | None) -> None:
        nonlocal failed
        ok, tried = totals.setdefault(group, [0, 0])
        skipped = problem == "skipped"
        totals[group] = [ok + (problem is None), tried + (not skipped)]
        failed += problem not in (None, "skipped")
        print(
            f"{group:12s} {'ok  ' if problem is None else 'FAIL' if not skipped else 'skip'} "
            f"{name}{'' if problem in (None, 'skipped') else ': ' + problem}",
            flush=True,
        )

    reference_dir = work / "reference"
    done = run(cli(reference_dir))
    if done.returncode != 0:
        print(done.stderr)
        return 1
    reference = losses(reference_dir)

    for n in range(args.kills):
        how = rng.choice(["SIGTERM", "SIGKILL", "SIGINT", "SIGINT twice"])
        record("kills", f"trial {n}: {how}", kill_trial(work, how, rng, reference, n))

    stopped = work / "stopped"
    done = run(cli(stopped, "train.stop_after=12"))
    for kind in CORRUPTIONS:
        record("corruptions", kind, corruption_trial(work, stopped, kind, reference))

    record("disk full", "tmpfs", disk_full_trial(work))

    # The model keys above are the quickstart's; a workload without one is not asked about it.
    keys = set(all_keys(workload=load_config(CONFIG, []).workload))
    for overrides in BAD_OVERRIDES:
        named = [o.partition("=")[0] for o in overrides]
        if any(k.startswith("model.") and k not in keys for k in named):
            continue
        record("bad inputs", " ".join(overrides), bad_input_trial(work, overrides))
    for name, content in BAD_FILES.items():
        path = work / f"bad-{name.replace(' ', '-')}.yaml"
        path.write_bytes(content)
        record("bad inputs", f"config file: {name}", bad_input_trial(work, [], str(path)))

    print()
    names = {
        "kills": "faults injected / survived with nothing lost",
        "corruptions": "corruptions / detected and fallen back",
        "disk full": "disk-full trials / one line, nothing lost",
        "bad inputs": "bad inputs / named in one line",
    }
    for group, (ok, tried) in totals.items():
        print(f"{names[group]}: {tried} / {ok}")
    print(json.dumps({group: {"tried": t, "ok": o} for group, (o, t) in totals.items()}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
