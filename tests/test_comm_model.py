"""tools/comm_model.py: communication time per step from the compiled step's collectives."""

import json
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
import comm_model


def test_model_from_compiled_steps(capsys):
    assert comm_model.main(
        ["--config", str(REPO / "configs" / "quickstart.yaml"), "mesh.data=8",
         "--schemes", "none,int8", "--json"]
    ) == 0  # fmt: skip
    rows = {(r["link"], r["scheme"]): r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {(link, s) for link in comm_model.LINKS for s in ("none", "int8")}
    nv = rows["nvlink4", "none"]
    # 820,352 fp32 gradients all-reduced over 8 devices: 2 x 7/8 x 4 bytes each (and 4 % more:
    # the tied embedding's two gradients are reduced before they are added).
    assert nv["sent_mib"] == pytest.approx(2 * 7 / 8 * 820_352 * 4 / 2**20, rel=0.05)
    assert nv["comm_ms"] == pytest.approx(nv["sent_mib"] * 2**20 / 450e9 * 1e3)
    # Overlap: forward (1/3 of the compute) + max(backward, communication).
    assert nv["step_ms_overlap"] == pytest.approx(
        nv["compute_ms"] / 3 + max(2 * nv["compute_ms"] / 3, nv["comm_ms"])
    )
    pcie = rows["pcie5", "none"]  # 18x slower links: communication no longer hides
    assert (
        pcie["step_ms_overlap"] == pytest.approx(pcie["compute_ms"] / 3 + pcie["comm_ms"])
        and pcie["comm_ms"] > 2 * pcie["compute_ms"] / 3
    )
    # int8 over all-to-all across nodes: its all-to-all is 8x slower per byte than the rings.
    a2a = rows["ib400", "int8"]
    assert a2a["comm_ms"] > 0.5 * a2a["sent_mib"] * 2**20 / (50e9 * 63 / 56) * 1e3
    assert rows["nvlink4", "int8"]["sent_mib"] < 0.26 * nv["sent_mib"]
    # 64 devices over InfiniBand: the ring factor grows from 1.75 to 1.97.
    ib = rows["ib400", "none"]
    assert ib["devices"] == 64
    assert ib["sent_mib"] / nv["sent_mib"] == pytest.approx((2 * 63 / 64) / (2 * 7 / 8), rel=0.01)
    for r in rows.values():
        assert r["step_ms_no_overlap"] == pytest.approx(r["compute_ms"] + r["comm_ms"])
        if r["scheme"] == "none":
            assert r["step_ms_overlap"] <= r["step_ms_no_overlap"]
        else:  # one reduction after the backward pass: nothing to hide it behind
            assert r["step_ms_overlap"] == r["step_ms_no_overlap"]


def test_unknown_link_is_one_line(capsys):
    with pytest.raises(SystemExit):
        comm_model.main(["--config", "x.yaml", "--links", "carrier-pigeon"])
    assert "unknown carrier-pigeon" in capsys.readouterr().err
