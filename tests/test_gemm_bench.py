"""tools/gemm_bench.py: the three GEMMs against numpy, alignment, peak lookup, the CLI's outputs."""

import csv
import importlib.util
import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO

TOOL = REPO / "tools" / "gemm_bench.py"
COLUMNS = [
    "device_kind",
    "dtype",
    "gemm",
    "n",
    "k",
    "m",
    "aligned",
    "median_s",
    "min_s",
    "tflops",
    "pct_peak",
]


def _load_tool():
    """tools/ is not a package: load the file as module `gemm_bench`."""
    spec = importlib.util.spec_from_file_location("gemm_bench", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


gb = _load_tool()


def _reference(gemm, a, b):
    """float64 numpy result of one GEMM; a, b as ordered in gb.GEMMS."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if gemm == "forward":
        return a @ b  # x @ w
    return a @ b.T if gemm == "act_grad" else a.T @ b  # dy @ w.T, x.T @ dy


@pytest.mark.parametrize("gemm", list(gb.GEMMS))
def test_gemms_match_numpy_in_fp32(gemm):
    n, k, m = 8, 96, 50
    operands = gb.make_operands(gemm, "fp32", n, k, m)
    spec = gb.DTYPES["fp32"]
    out = gb.GEMMS[gemm][0](*operands, out=spec.out, precision=spec.precision)
    expected_shape = {"forward": (n, m), "act_grad": (n, k), "weight_grad": (k, m)}[gemm]
    assert out.shape == expected_shape and out.dtype == jnp.float32
    np.testing.assert_allclose(out, _reference(gemm, *operands), rtol=1e-5, atol=1e-5)
    assert gb.gemm_flops(n, k, m) == 2 * m * n * k == 76_800


@pytest.mark.parametrize("gemm", list(gb.GEMMS))
def test_fp8_gemms_use_e4m3_forward_e5m2_grad_and_fp32_output(gemm):
    operands = gb.make_operands(gemm, "fp8", 16, 32, 48)
    expected = {"x": jnp.float8_e4m3fn, "w": jnp.float8_e4m3fn, "dy": jnp.float8_e5m2}
    assert [a.dtype for a in operands] == [expected[name] for name in gb.GEMMS[gemm][1]]
    spec = gb.DTYPES["fp8"]
    out = gb.GEMMS[gemm][0](*operands, out=spec.out, precision=spec.precision)
    assert out.dtype == jnp.float32
    # fp8 values are exact in float64 and the products are summed in fp32.
    np.testing.assert_allclose(out, _reference(gemm, *operands), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ((8, 96, 50), {"fp32": False, "bf16": False, "fp8": False}),  # M=50: not a multiple of 4
        ((8, 96, 64), {"fp32": True, "bf16": True, "fp8": False}),  # N=8 < the fp8 granule 16
        ((16, 96, 64), {"fp32": True, "bf16": True, "fp8": True}),
    ],
)
def test_alignment_flag_per_dtype(shape, expected):
    assert {d: gb.is_aligned(*shape, d) for d in expected} == expected


def test_peak_lookup():
    assert gb.peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert gb.peak_tflops("NVIDIA H100 80GB HBM3", "fp8") == 1978.9
    assert gb.peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert gb.peak_tflops("NVIDIA H200", "fp32") == 66.9
    assert gb.peak_tflops("NVIDIA A100-SXM4-80GB", "tf32") == 156.0
    assert gb.peak_tflops("NVIDIA A100-SXM4-80GB", "fp8") is None  # no fp8 on Ampere
    assert gb.peak_tflops("cpu", "bf16") is None
    assert gb.peak_tflops("Some Future Accelerator", "fp32") is None


def test_an_unsupported_case_is_a_skipped_row(monkeypatch):
    def unsupported(*args):
        raise TypeError("fp8 is not supported by this backend")

    monkeypatch.setattr(gb, "make_operands", unsupported)
    row = gb.bench_gemm("forward", "fp8", 16, 32, 32, device_kind="cpu", warmup=0, repeats=1)
    assert row.skipped == "TypeError: fp8 is not supported by this backend"
    assert row.tflops is None and row.median_s is None and row.flops == 2 * 16 * 32 * 32
    assert "skipped: TypeError" in gb.format_table([row])


def test_json_rows(tmp_path, capsys):
    argv = ["--quick", "--batches", "16", "--dtypes", "bf16", "--no-unaligned", "--repeats", "2"]
    assert gb.main([*argv, "--json", "--out-dir", str(tmp_path)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["dtype"], r["gemm"], r["n"], r["k"], r["m"]) for r in rows] == [
        ("bf16", g, 16, 64, 64) for g in gb.GEMMS
    ]
    assert all(r["tflops"] > 0 and r["pct_peak"] is None and r["aligned"] for r in rows)


def test_quick_cli_writes_csv_table_and_plot(tmp_path):
    argv = ["--quick", "--batches", "8,16", "--in", "32", "--out", "48", "--repeats", "2"]
    proc = subprocess.run(
        [sys.executable, str(TOOL), *argv, "--out-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    with (tmp_path / "gemm_bench.csv").open() as f:
        reader = csv.DictReader(f)
        assert set(COLUMNS) <= set(reader.fieldnames)
        rows = list(reader)
    # Each case is printed to stderr as it finishes: a sweep cut by a timeout still shows them.
    progress = [line for line in proc.stderr.splitlines() if " N=" in line]
    assert len(progress) == len(rows) and all("TFLOP/s" in line for line in progress)
    keys = [(r["dtype"], r["gemm"], int(r["n"]), int(r["k"]), int(r["m"])) for r in rows]
    expected = [
        (d, g, n, k, m)
        for d in ("fp32", "bf16", "fp8")
        for k, m in ((32, 48), (31, 47))
        for n in (8, 16)
        for g in gb.GEMMS
    ]
    assert sorted(keys) == sorted(expected)
    for r, (dtype, _, n, k, m) in zip(rows, keys, strict=True):
        assert r["aligned"] == str(gb.is_aligned(n, k, m, dtype))
        assert r["skipped"] or float(r["tflops"]) > 0, r
        if not r["skipped"]:
            assert float(r["min_s"]) <= float(r["median_s"])
            assert float(r["tflops"]) == pytest.approx(2 * n * k * m / float(r["median_s"]) / 1e12)
    assert proc.stdout.splitlines()[0].split()[:3] == ["dtype", "gemm", "N"]
    assert len(proc.stdout.splitlines()) == 1 + len(expected)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "gemm_bench.png").stat().st_size > 0
    else:
        assert "plot skipped" in proc.stderr
