"""hopperjax.inspect: GEMMs, FLOPs, collectives and advice from the compiled step."""

import json

import jax
import jax.numpy as jnp
import pytest
from conftest import REPO, TINY

import hopperjax
from hopperjax import inspect as inspect_lib
from hopperjax.models import gpt
from hopperjax.observe import hlo


@pytest.fixture(scope="module")
def quickstart_report():
    config = hopperjax.load_config(REPO / "configs" / "quickstart.yaml", ["mesh.data=1"])
    return config, inspect_lib.inspect_config(config, devices=jax.devices()[:1])


def test_forward_gemm_flops_equal_the_analytic_count(quickstart_report):
    config, report = quickstart_report
    forward = sum(g["flops"] for g in report["gemms"] if g["role"] == "forward")
    tokens = config.train.batch_size * config.data.seq_len
    analytic = tokens * gpt.forward_flops_per_token(config.model, config.data.seq_len)
    assert forward == pytest.approx(analytic, rel=0.01)
    # Backward = 2 x forward (activation and weight gradients); no remat -> no recompute.
    assert report["flops_per_step"] == pytest.approx(report["model_flops_per_step"], rel=0.01)
    assert report["recompute_ratio"] == pytest.approx(1.0, rel=0.01)


def test_report_shape(quickstart_report):
    config, report = quickstart_report
    assert report["params"]["count"] == 820_352
    assert report["params"]["bytes"] == 4 * 820_352
    assert report["memory"]["argument_bytes"] >= report["params"]["bytes"]
    assert report["memory"]["temp_bytes"] > 0
    roles = {g["role"] for g in report["gemms"]}
    assert roles == {"forward", "act_grad", "weight_grad"}
    assert report["workload"] == "lm" and report["examples_name"] == "tokens"
    assert report["examples_per_step"] == config.train.batch_size * config.data.seq_len
    layers = {g["layer"] for g in report["gemms"]}
    assert {
        "blocks/qkv",
        "blocks/attn_out",
        "blocks/mlp_in",
        "blocks/mlp_out",
        "blocks/attention",
        "token_embed.attend",
    } <= layers
    # The scan runs each block GEMM once per layer.
    assert {g["count"] for g in report["gemms"] if g["layer"] == "blocks/qkv"} == {4}
    assert report["collectives"] == []  # one device
    json.dumps(report)


def test_two_x_layers_two_x_flops():
    def flops_for(layers: int) -> float:
        config = hopperjax.load_config(
            REPO / "configs" / "quickstart.yaml", [*TINY, f"model.n_layers={layers}", "mesh.data=1"]
        )
        return inspect_lib.inspect_config(config, devices=jax.devices()[:1])["flops_per_step"]

    two, four = flops_for(2), flops_for(4)
    # Only the output head does not scale with depth.
    config = hopperjax.load_config(None, TINY)
    head = 6 * config.train.batch_size * config.data.seq_len * 32 * 256
    assert (four - head) / (two - head) == pytest.approx(2.0, rel=1e-6)
    assert four / two > 1.5


def test_unaligned_dense_is_named_in_the_advice():
    x = jnp.ones((8, 96), jnp.bfloat16)
    w = jnp.ones((96, 50), jnp.bfloat16)

    def loss(w, x):
        return jnp.sum((x @ w).astype(jnp.float32) ** 2)

    compiled = jax.jit(jax.grad(loss)).lower(w, x).compile()
    # The parameters tell the weight gradient (x^T @ dy, the size of w) from other backward GEMMs.
    report = inspect_lib.compiled_report(compiled, num_devices=1, params={"w": w})
    forward = [g for g in report["gemms"] if g["role"] == "forward"]
    assert [(g["m"], g["n"], g["k"]) for g in forward] == [(8, 50, 96)]
    assert [g["role"] for g in report["gemms"] if g["role"] != "forward"] == ["weight_grad"]
    # XLA:CPU computes bf16 dots in f32 (multiple of 4 wanted); on GPU they stay bf16 (of 8).
    (finding,) = forward[0]["findings"]
    assert finding.startswith("n=50 is not a multiple of")
    assert any("n=50" in a and "pad it to" in a for a in report["advice"])
    assert not any("=96" in a or "=8 " in a for a in report["advice"])


def test_vocab_padding_advice():
    """The LM workload's advice; the report lists a workload's advice first."""

    def advice(vocab_size: int) -> list[str]:
        config = hopperjax.load_config(None, [f"model.vocab_size={vocab_size}"])
        return hopperjax.workloads.from_config(config).advice()

    padding = (
        "pad model.vocab_size 50257 -> 50304 (multiple of 128): the logits GEMM then tiles exactly"
    )
    assert advice(50257) == [padding]
    assert advice(256) == []
    assert inspect_lib.advise([], first=advice(50257)) == [padding]


def test_gradient_all_reduce_bytes_match_gradient_bytes():
    config = hopperjax.load_config(REPO / "configs" / "quickstart.yaml", ["mesh.data=8"])
    report = inspect_lib.inspect_config(config)
    reductions = [c for c in report["collectives"] if c["kind"] in ("all-reduce", "reduce-scatter")]
    assert reductions and all(c["group_size"] == 8 for c in reductions)
    reduced = sum(c["bytes"] * c["count"] for c in reductions)
    assert reduced == pytest.approx(report["params"]["bytes"], rel=0.05)


def test_wave_quantization_estimate():
    # 132 SMs, 128x128 tiles: an 8448x2048 output is 66 x 16 = 1056 tiles = exactly 8 waves.
    assert inspect_lib.tile_efficiency(8448, 2048, 1, (128, 128)) == pytest.approx(1.0)
    # One tile more than a full wave leaves the second wave almost empty.
    assert inspect_lib.tile_efficiency(128 * 133, 128, 1, (128, 128)) == pytest.approx(133 / 264)
    # A partial tile computes padding.
    assert inspect_lib.tile_efficiency(64, 128, 132, (128, 128)) == pytest.approx(0.5)


def test_cublas_custom_call_gemms_are_parsed():
    dims = (
        '"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
        '"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],'
        '"rhs_batch_dimensions":[]}'
    )
    text = "\n".join([
        "HloModule m, entry_computation_layout={()->()}",
        "",
        "ENTRY %main (p0: bf16[4096,1024], p1: bf16[1024,8192]) -> bf16[4096,8192] {",
        "  %p0 = bf16[4096,1024]{1,0} parameter(0)",
        "  %p1 = bf16[1024,8192]{1,0} parameter(1)",
        "  %custom-call.3 = (bf16[4096,8192]{1,0}, s8[4194304]{0}) custom-call(%p0, %p1), "
        'custom_call_target="__cublas$gemm", '
        'metadata={op_name="jit(f)/jvp(GPT)/blocks/mlp_in/dot_general"}, '
        'backend_config={"gemm_backend_config":{"alpha_real":1,' + dims + "}}",
        "  %all-reduce-start.1 = bf16[4096,1024]{1,0} all-reduce-start(%p0), "
        "replica_groups=[2,4]<=[8], to_apply=%add",
        "  ROOT %gte = bf16[4096,8192]{1,0} get-tuple-element(%custom-call.3), index=0",
        "}",
    ])  # fmt: skip
    gemms, collectives = hlo.analyze(text, num_devices=8)
    assert [(g.m, g.n, g.k, g.batch, g.lhs_dtype, g.count) for g in gemms] == [
        (4096, 8192, 1024, 1, "bf16", 1)
    ]
    assert gemms[0].flops == 2 * 4096 * 8192 * 1024
    assert [(c.kind, c.group_size, c.bytes) for c in collectives] == [
        ("all-reduce", 4, 4096 * 1024 * 2)
    ]


def test_cli_prints_json_and_table(tmp_path, capsys):
    args = ["--config", str(REPO / "configs" / "quickstart.yaml"), *TINY, "mesh.data=8"]
    hlo_path = tmp_path / "step.hlo"
    assert inspect_lib.main([*args, "--hlo", str(hlo_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}
    assert "dot(" in hlo_path.read_text()
    # Overrides may follow a flag (argparse's plain parse refused this with exit code 2).
    assert inspect_lib.main([*args[:-1], "--format", "table", args[-1]]) == 0
    assert "blocks/mlp_in" in capsys.readouterr().out
    assert inspect_lib.main([*args, "trian.steps=3"]) == 2
