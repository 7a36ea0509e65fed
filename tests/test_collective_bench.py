"""tools/collective_bench.py: every collective over the 8 fake devices, one device's copies."""

import csv
import sys

import jax
import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
import collective_bench


def test_sweep_over_eight_devices_writes_csv_and_busbw(tmp_path, capsys):
    assert collective_bench.main(
        ["--min-size", "1KiB", "--max-size", "16KiB", "--warmup", "1", "--repeats", "2",
         "--out-dir", str(tmp_path)]
    ) == 0  # fmt: skip
    with (tmp_path / "collective_bench.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(dict.fromkeys(r["op"] for r in rows)) == list(collective_bench.OPS)
    assert {int(r["size_bytes"]) for r in rows} == {1024, 4096, 16384}
    for r in rows:
        factor = collective_bench.bus_factor(r["op"], 8)
        assert float(r["busbw_gbps"]) == pytest.approx(float(r["algbw_gbps"]) * factor)
        assert int(r["devices"]) == jax.device_count() == 8
    assert "busbw GB/s" in capsys.readouterr().out


def test_one_device_measures_copies(tmp_path):
    collective_bench.main(
        ["--devices", "1", "--min-size", "4KiB", "--max-size", "4KiB", "--repeats", "1",
         "--out-dir", str(tmp_path), "--json"]
    )  # fmt: skip
    with (tmp_path / "collective_bench.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["op"] for r in rows] == list(collective_bench.ONE_DEVICE_OPS)
    assert all(float(r["time_us"]) > 0 for r in rows)


def test_factors_and_sizes():
    assert collective_bench.bus_factor("all-reduce", 8) == pytest.approx(1.75)
    assert collective_bench.bus_factor("all-gather", 8) == pytest.approx(0.875)
    assert collective_bench.bus_factor("ppermute", 8) == 1.0
    assert collective_bench.parse_size("64MiB") == 64 << 20
    assert collective_bench.sizes(1024, 16384, 4) == [1024, 4096, 16384]


def test_op_that_needs_more_devices_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        collective_bench.main(["--devices", "1", "--ops", "all-reduce"])
    assert info.value.code == 2
    assert "needs several" in capsys.readouterr().err
