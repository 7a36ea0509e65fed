"""tools/bench_loop.py runs end to end and reports consistent figures."""

import importlib.util
import json

from conftest import REPO, TINY


def test_bench_loop_reports_all_three_measurements(capsys):
    spec = importlib.util.spec_from_file_location("bench_loop", REPO / "tools" / "bench_loop.py")
    bench_loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_loop)
    args = [
        "--config",
        str(REPO / "configs" / "quickstart.yaml"),
        *TINY,
        "--steps",
        "10",
        "--chunk",
        "5",
        "--pipeline-batches",
        "20",
    ]
    assert bench_loop.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["devices"] == 8
    assert report["bare_step_s"] > 0 and report["loop_step_s"] > 0
    assert report["loop_over_bare"] == report["loop_step_s"] / report["bare_step_s"]
    assert report["step_batches_per_s"] == 1 / report["bare_step_s"]
    rates = (report["host_batches_per_s"], report["device_batches_per_s"])
    assert report["pipeline_over_step"] == min(rates) / report["step_batches_per_s"]
    assert report["ok"] == (
        report["loop_over_bare"] <= 1.05 and report["pipeline_over_step"] >= 5.0
    )
