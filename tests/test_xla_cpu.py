"""``cpu_convolutions`` (hopperjax/xla_cpu.py): the XLA:CPU flag that takes convolutions out of
YNNPACK's fusions, how it is set, and that the compiled step then has none there."""

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO

from hopperjax import xla_cpu
from hopperjax.config import ConfigError, load_config

EIGEN = xla_cpu.FLAGS["eigen"][0]
NHWC = ("NHWC", "HWIO", "NHWC")
# testenv probed the flag for this test run and put it in XLA_FLAGS where jaxlib accepts it.
needs_flag = pytest.mark.skipif(
    EIGEN not in os.environ["XLA_FLAGS"].split(), reason="this jaxlib has no YNNPACK fusion flag"
)


@pytest.fixture
def accepted(monkeypatch):
    monkeypatch.setattr(xla_cpu, "jaxlib_accepts", lambda flag: True)


def test_eigen_sets_its_flag_once_and_ynnpack_sets_nothing(accepted):
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert xla_cpu.apply("eigen", env) is None
    assert env["XLA_FLAGS"].split() == [EIGEN, "--xla_dump_to=/tmp/x"]
    xla_cpu.apply("eigen", env)  # idempotent
    assert env["XLA_FLAGS"].split() == [EIGEN, "--xla_dump_to=/tmp/x"]
    env = {}
    assert xla_cpu.apply("ynnpack", env) is None
    assert env == {}
    assert xla_cpu.apply("eigen", env) is None
    assert env == {"XLA_FLAGS": EIGEN}
    with pytest.raises(ValueError, match="cpu_convolutions"):
        xla_cpu.apply("onednn", {})
    with pytest.raises(ConfigError, match="cpu_convolutions"):
        load_config(REPO / "configs" / "quickstart.yaml", ["cpu_convolutions=onednn"])


@pytest.mark.parametrize(
    "mode, flags, named",
    [
        ("eigen", f"{xla_cpu.FLAG_NAME}=", f"{xla_cpu.FLAG_NAME}="),
        ("ynnpack", f"--xla_dump_to=/tmp/x {EIGEN}", EIGEN),
        (
            "eigen",
            f"{EIGEN} {xla_cpu.FLAG_NAME}=-individual_dot",
            f"{xla_cpu.FLAG_NAME}=-individual_dot",
        ),
    ],
)
def test_the_users_own_setting_wins_and_is_said(accepted, mode, flags, named):
    env = {"XLA_FLAGS": flags}
    line = xla_cpu.apply(mode, env)
    assert env == {"XLA_FLAGS": flags}
    assert line == f"hopperjax: cpu_convolutions={mode} not applied: XLA_FLAGS sets {named}"


def test_a_flag_file_is_left_to_xla(accepted):
    """XLA reads an XLA_FLAGS that is not flags as a file of flags; a flag put in front would
    make it a list of flags and the file unread."""
    env = {"XLA_FLAGS": "/etc/xla/flags.txt"}
    line = xla_cpu.apply("eigen", env)
    assert env == {"XLA_FLAGS": "/etc/xla/flags.txt"}
    assert line == "hopperjax: cpu_convolutions=eigen not applied: XLA_FLAGS names a flag file"
    assert xla_cpu.apply("ynnpack", env) is None
    assert env == {"XLA_FLAGS": "/etc/xla/flags.txt"}


def test_a_jaxlib_without_the_flag_gets_none_and_a_line(monkeypatch):
    """XLA aborts the process on a flag it does not know, so none is set where jaxlib lacks it."""
    monkeypatch.setattr(xla_cpu, "jaxlib_accepts", lambda flag: False)
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    line = xla_cpu.apply("eigen", env)
    assert env == {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert "not applied: this jaxlib has no" in line


@pytest.fixture
def fresh_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("HOPPERJAX_CACHE_DIR", str(tmp_path))
    xla_cpu.jaxlib_accepts.cache_clear()
    yield tmp_path / "xla_flags.json"
    xla_cpu.jaxlib_accepts.cache_clear()


def test_the_probe_starts_jax_once_per_jaxlib_and_keeps_the_answer(fresh_probe, monkeypatch):
    """A known flag runs; an unknown one aborts JAX's start, and so does a removed flag whose
    name jaxlib's libraries still hold (jaxlib 0.10: in the proto descriptor)."""
    known = "--xla_force_host_platform_device_count=1"
    unknown = "--xla_hopperjax_no_such_flag=1"
    assert xla_cpu.jaxlib_accepts(known)
    assert not xla_cpu.jaxlib_accepts(unknown)
    kept = json.loads(fresh_probe.read_text())
    assert list(kept.values()) == [{known: True, unknown: False}]
    # Asked again in another process (the in-memory cache cleared): read, not probed.
    xla_cpu.jaxlib_accepts.cache_clear()
    kept[next(iter(kept))][unknown] = True  # a planted answer shows where it came from
    fresh_probe.write_text(json.dumps(kept))
    monkeypatch.setattr(subprocess, "run", None)  # a probe would fail
    assert xla_cpu.jaxlib_accepts(unknown)


def test_a_removed_flag_is_refused_and_a_failed_probe_not_kept(fresh_probe, monkeypatch):
    if jax.__version__.startswith("0.10."):  # the removed flag's name is in jaxlib 0.10's binary
        assert not xla_cpu.jaxlib_accepts("--xla_gpu_enable_cudnn_frontend=true")
    xla_cpu.jaxlib_accepts.cache_clear()
    fresh_probe.unlink(missing_ok=True)
    killed = subprocess.CompletedProcess([], -9, b"", b"Killed")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: killed)
    assert not xla_cpu.jaxlib_accepts("--xla_force_host_platform_device_count=2")
    assert not fresh_probe.exists()  # not an answer about the flag: asked again next time


def test_prepare_process_says_each_line_once(monkeypatch):
    monkeypatch.setattr(xla_cpu, "_SAID", set())
    monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to=/tmp/x {xla_cpu.FLAG_NAME}=")
    config = SimpleNamespace(comm=SimpleNamespace(overlap="aggressive"), cpu_convolutions="eigen")
    jax.devices()  # JAX runs here: overlap's flags cannot be set
    assert xla_cpu.prepare_process(config) == [
        "hopperjax: comm.overlap=aggressive not applied: JAX already started",
        f"hopperjax: cpu_convolutions=eigen not applied: XLA_FLAGS sets {xla_cpu.FLAG_NAME}=",
    ]
    assert xla_cpu.prepare_process(config) == []


def test_a_started_backend_is_refused(accepted, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    jax.devices()  # this process's backend runs
    with pytest.raises(RuntimeError, match="before JAX starts"):
        xla_cpu.apply("eigen")


def _convolutions_in_ynn_fusions(hlo: str) -> int:
    """Convolutions inside the computations that ``__ynn_fusion`` fusions call."""
    called = set(re.findall(r"calls=%?([\w.\-]+)[^\n]*\"__ynn_fusion\"", hlo))
    bodies = re.findall(r"^%?([\w.\-]+) [^\n]*\{\n(.*?)^\}", hlo, flags=re.M | re.S)
    return sum(body.count(" convolution(") for name, body in bodies if name in called)


@needs_flag
def test_the_cli_takes_the_steps_convolutions_out_of_ynnpack(tmp_path):
    """``hopperjax.inspect`` (which applies the key as the train CLI does) compiles a small
    ResNet-9 step in a process whose XLA_FLAGS lack the flag: with the default, no convolution
    runs in a YNNPACK fusion (that this jaxlib otherwise puts them there, so that the check can
    fail, is shown by ``test_both_libraries_give_the_same_gradients``)."""
    env = dict(os.environ)  # the tests' flags, less the one under test
    env["XLA_FLAGS"] = " ".join(f for f in env["XLA_FLAGS"].split() if f != EIGEN)
    hlo = tmp_path / "step.hlo"
    out = subprocess.run(
        [sys.executable, "-m", "hopperjax.inspect", "--config", "configs/cifar10_resnet.yaml",
         "data.source=synthetic", "data.path=null", "data.synthetic_images=32",
         "train.batch_size=8", "model.width=4", "--hlo", str(hlo)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    text = hlo.read_text()
    assert text.count(" convolution(") >= 20  # 8 layers' forward and gradients
    assert '"__ynn_fusion"' in text  # YNNPACK still runs the rest
    assert _convolutions_in_ynn_fusions(text) == 0


@needs_flag
def test_both_libraries_give_the_same_gradients():
    """A ResNet-9-like layer's forward, input and weight gradients from YNNPACK (compiled with the
    fusion list that holds convolutions) and from this process's default (Eigen) agree within
    float32 summation-order noise."""

    def loss(x, w):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NHWC)
        return jnp.sum(jnp.tanh(y) * jnp.arange(y.shape[-1], dtype=y.dtype))

    k1, k2 = jax.random.split(jax.random.key(0))
    x = jax.random.normal(k1, (4, 8, 8, 16))
    w = jax.random.normal(k2, (3, 3, 16, 32)) * 0.1
    grads = jax.value_and_grad(loss, argnums=(0, 1))
    # The per-compile form of the flag takes enum names; this list holds convolutions only.
    ynn_options = {xla_cpu.FLAG_NAME[2:]: "LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION"}
    ynn = jax.jit(grads, compiler_options=ynn_options)
    eigen = jax.jit(grads)
    assert _convolutions_in_ynn_fusions(ynn.lower(x, w).compile().as_text()) > 0
    assert _convolutions_in_ynn_fusions(eigen.lower(x, w).compile().as_text()) == 0
    (a_loss, (a_dx, a_dw)), (b_loss, (b_dx, b_dw)) = ynn(x, w), eigen(x, w)
    np.testing.assert_allclose(a_loss, b_loss, rtol=1e-5)
    for a, b in ((a_dx, b_dx), (a_dw, b_dw)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()))


def test_a_call_after_jax_started_says_the_flag_was_not_set(accepted, monkeypatch):
    """``hopperjax.train`` applies the key itself for scripts (``apply_or_say``); where JAX
    started first it cannot, and says so on CPU, naming what to do."""
    monkeypatch.setenv("XLA_FLAGS", "")
    jax.devices()
    assert xla_cpu.apply_or_say("eigen") == (
        "hopperjax: cpu_convolutions=eigen not applied: JAX started first (call "
        "hopperjax.xla_cpu.prepare_process(config) before it starts, or add "
        f"{EIGEN} to XLA_FLAGS)"
    )
    assert xla_cpu.apply_or_say("ynnpack") is None


def test_a_flag_file_is_left_whole_by_both_keys(accepted, monkeypatch):
    monkeypatch.setattr(xla_cpu, "_SAID", set())
    monkeypatch.setenv("XLA_FLAGS", "/etc/xla/flags.txt")
    config = SimpleNamespace(comm=SimpleNamespace(overlap="aggressive"), cpu_convolutions="eigen")
    assert xla_cpu.prepare_process(config) == [
        "hopperjax: comm.overlap=aggressive not applied: XLA_FLAGS names a flag file",
        "hopperjax: cpu_convolutions=eigen not applied: XLA_FLAGS names a flag file",
    ]
    assert os.environ["XLA_FLAGS"] == "/etc/xla/flags.txt"


def _conv_bench():
    """tools/ is not a package: load tools/conv_bench.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("conv_bench", REPO / "tools" / "conv_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_conv_bench_times_each_layer_and_refuses_bad_shapes(capsys):
    bench = _conv_bench()
    assert bench.main(["--layers", "4:3:8,2:8:8", "--batch", "2", "--reps", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["layer"] for r in rows] == ["4x4 3->8", "2x2 8->8"]
    assert rows[0]["gflop"] == round(2 * 2 * 4 * 4 * 9 * 3 * 8 / 1e9, 3)
    for r in rows:
        for name in ("forward", "input_grad", "weight_grad"):
            assert r[f"{name}_ms"] > 0 and r[f"{name}_gflops"] >= 0  # tiny: may round to 0
    assert bench.main(["--layers", "2:8:8", "--batch", "1", "--reps", "1"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split() == ["layer", "forward", "input", "grad", "weight", "grad"]
    cells = table[2].split()  # the layer, then three "ms (GFLOP/s)" cells
    assert cells[:2] == ["2x2", "8->8"] and len(cells) == 8
    assert all(float(ms) > 0 for ms in cells[2::2])
    with pytest.raises(SystemExit):
        bench.main(["--layers", "4:3"])
