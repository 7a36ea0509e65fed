"""The CLI contract: bad config -> exit code 2 and one line naming the key; a run writes its dir."""

import importlib
import json
import os
import re
import subprocess
import sys
from itertools import pairwise

import pytest
import yaml
from conftest import REPO, TINY

import hopperjax

CLI = [sys.executable, "-m", "hopperjax.train"]


def run_cli(
    *overrides: str,
    config: str | os.PathLike[str] = "configs/quickstart.yaml",
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, "--config", str(config), *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ),
    )


def main_in_process(argv: list[str], capsys, monkeypatch) -> tuple[int, str]:
    """The CLI's ``main`` run here (a subprocess costs ~3 s of imports per case) for configs it
    refuses while loading them: before it sets anything process-wide (XLA flags, JAX config),
    which ``xla_cpu.prepare_process`` failing the test proves. -> (exit code, stderr)."""

    def too_far(config):
        raise AssertionError("the CLI went past loading the config (to its XLA flags)")

    cli = importlib.import_module("hopperjax.cli")
    # The library's function, whatever was imported before: the CLI's module shadows nothing.
    assert hopperjax.train is hopperjax.trainer.train
    monkeypatch.setattr(cli.xla_cpu, "prepare_process", too_far)
    code = cli.main(argv)
    return code, capsys.readouterr().err


def assert_one_config_line(code: int, stderr: str, fragment: str) -> str:
    assert code == 2, stderr
    # One line of ours and no traceback; a dependency's warning lines may come and go.
    lines = [line for line in stderr.splitlines() if line.startswith("hopperjax:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("hopperjax: config error:")
    assert fragment in lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["trian.steps=5"], "train.steps"),  # unknown key, nearest name suggested
        (["train.steps=ten"], "train.steps"),  # wrong type
        (["train.steps=-1"], "train.steps"),  # bad value
        (["data.source=text", "data.path=/no/such/file.txt"], "data.path"),  # missing data file
        (["workload=lmm"], "unknown workload 'lmm'; did you mean 'lm'?"),  # unknown workload
    ],
    ids=[
        "unknown-key",
        "bad-type",
        "negative-steps",
        "missing-file",
        "unknown-workload",
    ],
)
def test_bad_config_exits_2_with_one_line(overrides, key, tmp_path, capsys, monkeypatch):
    argv = [
        "--config",
        str(REPO / "configs" / "quickstart.yaml"),
        *overrides,
        f"run_dir={tmp_path}",
    ]
    assert_one_config_line(*main_in_process(argv, capsys, monkeypatch), key)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["mesh.data=8", "train.batch_size=12"], "train.batch_size"),  # not divisible by data axis
        # a mesh axis that does not divide what it shards (4 heads over 8 tensor shards)
        (["mesh.data=1", "mesh.tensor=8", "model.n_heads=4"], "mesh.tensor"),
        # a state far larger than the device: refused from the compiled step, before allocating
        (["model.max_len=100000000000", "model.positions=learned"], "GiB per device"),
    ],
    ids=["batch-vs-mesh", "mesh-indivisible", "model-too-large"],
)
def test_a_config_refused_once_built_exits_2_with_one_line(overrides, key, tmp_path):
    """Refused once the devices, the model and its sharded step are known: the real CLI, in its
    own process, from ``python -m`` to the exit code."""
    proc = run_cli(*overrides, f"run_dir={tmp_path}")
    assert_one_config_line(proc.returncode, proc.stderr, key)


# A YAML alias bomb: 9 levels of lists of 9 aliases each (9**9 leaves) as the workload's name.
ALIAS_BOMB = (
    "a: &a [x,x,x,x,x,x,x,x,x]\n"
    + "".join(f"{n}: &{n} [{','.join([f'*{p}'] * 9)}]\n" for p, n in pairwise("abcdefghi"))
    + "workload: *i\n"
)


@pytest.mark.parametrize(
    ("content", "fragment", "isolated"),
    [
        ("name: caf\xe9\n".encode("latin-1"), "not UTF-8", False),
        # Its own process with a time limit: were the expansion ever unbounded again, it would
        # fail here rather than hang or exhaust a test worker.
        (ALIAS_BOMB.encode(), "workload:", True),
    ],
    ids=["latin-1-file", "alias-bomb"],
)
def test_bad_config_file_exits_2_with_one_short_line(
    content, fragment, isolated, tmp_path, capsys, monkeypatch
):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    if isolated:
        proc = run_cli(f"run_dir={tmp_path}", config=path, timeout=120)
        code, stderr = proc.returncode, proc.stderr
    else:
        argv = ["--config", str(path), f"run_dir={tmp_path}"]
        code, stderr = main_in_process(argv, capsys, monkeypatch)
    line = assert_one_config_line(code, stderr, fragment)
    assert len(line) < 300 and len(stderr) < 2000, stderr  # nothing else of size either


def test_cli_trains_and_writes_the_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(*TINY, "train.stop_after=4", "train.eval_every=2", f"run_dir={run_dir}")
    assert proc.returncode == 0, proc.stderr
    assert "host heap keeps" in proc.stdout  # XLA:CPU's step buffer stays resident (glibc)
    assert (run_dir / "config.yaml").is_file()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [0, 1, 2, 3]
    for r in train_records:
        assert {"step", "loss", "lr", "step_time_s", "tokens_per_s", "grad_norm"} <= r.keys()
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["4"]
    assert any((run_dir / "tb").glob("events.out.tfevents.*"))


def test_cli_trains_with_grain_worker_processes(tmp_path):
    """data.workers > 0 through the CLI, where nothing parses absl flags (google/grain#1355)."""
    proc = run_cli(*TINY, "train.stop_after=2", "data.workers=1", f"run_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    logged = re.findall(r"^step +(\d+)/20 ", proc.stdout, re.M)
    assert logged == ["1", "2"], proc.stdout  # updates done


def test_print_config_prints_every_key_and_starts_nothing():
    proc = run_cli("--print-config", "train.steps=7", timeout=120)
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["train"]["steps"] == 7
    assert printed["comm"]["overlap"] == "default"  # a default the YAML file never names
    assert printed["optim"]["b1"] == 0.9


def test_warmup_that_covers_the_run_is_said(tmp_path, capsys):
    import hopperjax

    config = hopperjax.load_config(
        REPO / "configs" / "quickstart.yaml",
        [*TINY, "train.steps=3", "optim.warmup_steps=3", f"run_dir={tmp_path}"],
    )
    hopperjax.train(config)
    assert "optim.warmup_steps=3 >= train.steps=3" in capsys.readouterr().out
