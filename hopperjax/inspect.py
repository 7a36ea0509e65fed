"""Compile-only inspection of the train step.

    python -m hopperjax.inspect --config FILE [key=value ...] [--hlo PATH] [--format table]


Lowers and compiles the step for the configured mesh without running it and prints one JSON
object: parameters, per-device memory (XLA memory analysis), FLOPs (from the GEMMs of the
optimized HLO, counted per loop trip, and XLA's own cost analysis), every GEMM with its sizes,
dtypes, layer, role and alignment, every collective with its bytes and group size, and advice.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from typing import Any

import jax

from hopperjax import xla_cpu
from hopperjax.config import Config, ConfigError, load_config
from hopperjax.memory import budget, offload
from hopperjax.observe import hlo as hlo_lib
from hopperjax.trainer import build_components

WeightSizes = dict[str, set[int]]

# Tensor Cores want every GEMM dim a multiple of this many elements (NVIDIA's guidance).
ALIGNMENT = {"f8e4m3fn": 16, "f8e5m2": 16, "bf16": 8, "f16": 8, "f32": 4}
NUM_SMS = 132  # H100 SXM / H200
TILES = ((128, 128), (128, 256))
# Wrappers JAX adds to op names; stripped to leave the model's own module path.
_WRAPPERS = re.compile(
    r"^(jit|jvp|transpose|vmap|remat|checkpoint|pjit|closed_call|while|body|"
    r"cond|branch|shard_map|custom_jvp_call|custom_vjp_call)\b"
)


def layer_of(op_name: str) -> str:
    """'jit(train_step)/transpose(jvp(Net))/while/body/closed_call/blocks/mlp_in/dot_general'
    -> 'blocks/mlp_in'."""
    # jnp.einsum names a scope after its spec ('btnh,bsnh->bnts'): a detail of the layer.
    parts = [p for p in op_name.split("/")[:-1] if not _WRAPPERS.match(p) and "->" not in p]
    return "/".join(parts) or op_name


def weight_sizes(params: Any) -> WeightSizes:
    """Per layer (``"blocks/mlp_in"``), the element counts a gradient of one of its weights can
    have in the per-device program: the whole weight, one layer of a scanned stack, and the same
    for a device's shard when the weight is sharded.

    ``params``: the parameters as arrays or ``jax.ShapeDtypeStruct`` (with shardings, if any).
    Vectors (biases, norm scales) are left out: no GEMM produces them.
    """
    sizes: WeightSizes = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        shape = tuple(leaf.shape)
        if len(shape) < 2:
            continue
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        shapes = [shape]
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            shapes.append(tuple(sharding.shard_shape(shape)))
        layer = sizes.setdefault("/".join(keys[:-1]), set())
        for dims in shapes:
            layer.update({math.prod(dims), math.prod(dims[1:])})
    return sizes


def gemm_role(gemm: hlo_lib.Gemm, weights: WeightSizes | None) -> str:
    """forward / act_grad / weight_grad (/ unknown) of a GEMM or convolution of a train step.

    Forward GEMMs are those outside autodiff's transpose. Of the backward ones, a weight
    gradient produces an array the size of one of its layer's weights (x^T @ dy); an activation
    gradient produces one the size of the layer's input. ``weights``: ``weight_sizes`` of the
    model's parameters; without it every backward GEMM counts as an activation gradient.
    XLA:CPU drops the op name of the convolutions it rewrites for weight gradients: a GEMM
    without one is a weight gradient if its output has the size of a weight, else unknown.
    """
    out = gemm.batch * gemm.m * gemm.n
    if not gemm.op_name:
        every = set().union(*weights.values()) if weights else set()
        return "weight_grad" if out in every else "unknown"
    if "transpose(" not in gemm.op_name:
        return "forward"
    if not weights:
        return "act_grad"
    segments = layer_of(gemm.op_name).split("/")
    own = [sizes for name, sizes in weights.items() if _within(name.split("/"), segments)]
    candidates = set().union(*own) if own else set().union(*weights.values())
    return "weight_grad" if out in candidates else "act_grad"


def _within(param_layer: list[str], segments: list[str]) -> bool:
    """Whether a parameter's layer path (``["encoder", "conv0"]``) occurs in a GEMM's layer
    path (``["Net._encode", "encoder", "conv0"]``; ``token_embed.attend`` is in
    ``token_embed``)."""
    n = len(param_layer)
    for i in range(len(segments) - n + 1):
        window = segments[i : i + n]
        if window[:-1] == param_layer[:-1] and (
            window[-1] == param_layer[-1] or window[-1].startswith(param_layer[-1] + ".")
        ):
            return True
    return False


def _largest_pow2_divisor(x: int, cap: int = 128) -> int:
    d = 1
    while d < cap and x % (2 * d) == 0:
        d *= 2
    return d


def tile_efficiency(m: int, n: int, batch: int, tile: tuple[int, int]) -> float:
    """Useful fraction of the work of a GEMM split into output tiles run in waves over 132 SMs.

    Tile quantization: partial tiles at the edges compute padding. Wave quantization: the last
    wave of tiles leaves SMs idle.
    """
    tm, tn = tile
    tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
    waves = math.ceil(tiles / NUM_SMS)
    return (batch * m * n) / (waves * NUM_SMS * tm * tn)


def gemm_entry(gemm: hlo_lib.Gemm, weights: WeightSizes | None) -> dict[str, Any]:
    need = ALIGNMENT.get(gemm.lhs_dtype, 8)
    dims = {"m": gemm.m, "n": gemm.n, "k": gemm.k}
    findings = [
        f"{d}={v} is not a multiple of {need} ({gemm.lhs_dtype})"
        for d, v in dims.items()
        if v % need
    ]
    return {
        "layer": layer_of(gemm.op_name),
        "role": gemm_role(gemm, weights),
        "m": gemm.m, "n": gemm.n, "k": gemm.k, "batch": gemm.batch,
        "dtypes": [gemm.lhs_dtype, gemm.rhs_dtype, gemm.out_dtype],
        "count": gemm.count,
        "flops": gemm.flops,
        "alignment": {d: _largest_pow2_divisor(v) for d, v in dims.items()},
        "findings": findings,
        "efficiency_132sm": {f"{t[0]}x{t[1]}": round(tile_efficiency(gemm.m, gemm.n, gemm.batch, t),
                                                      3) for t in TILES},
        "hlo": gemm.name,
    }  # fmt: skip


def advise(gemms: list[dict[str, Any]], *, first: list[str] = ()) -> list[str]:
    """Concrete, checkable suggestions from the GEMM list, after ``first`` (the workload's)."""
    advice = list(first)
    total = sum(g["flops"] for g in gemms) or 1
    seen = set()
    for g in sorted(gemms, key=lambda g: -g["flops"]):
        need = ALIGNMENT.get(g["dtypes"][0], 8)
        for dim in ("m", "n", "k"):
            value = g[dim]
            if value % need == 0 or (g["layer"], value) in seen:
                continue
            seen.add((g["layer"], value))
            padded = -(-value // need) * need
            advice.append(
                f"{g['layer']}: {dim}={value} ({g['role']} GEMM {g['m']}x{g['n']}x"
                f"{g['k']}, {g['dtypes'][0]}) is not a multiple of {need}; pad it to "
                f"{padded} so Tensor Cores run at full rate"
            )
        best = max(g["efficiency_132sm"].values())
        if g["flops"] / total > 0.05 and best < 0.75 and ("eff", g["layer"]) not in seen:
            seen.add(("eff", g["layer"]))
            advice.append(
                f"{g['layer']}: {g['role']} GEMM {g['m']}x{g['n']}x{g['k']} fills only "
                f"{best:.0%} of 132 SMs in whole tiles and waves; larger or "
                f"128-multiple m/n (batch, sequence, width) would raise it"
            )
    return advice


def _xla_flops(compiled: jax.stages.Compiled) -> float | None:
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older JAX: one dict per device program
        cost = cost[0] if cost else None
    return float(cost["flops"]) if cost and "flops" in cost else None


_LOWERED_DOT = re.compile(
    r"stablehlo\.dot_general.*?: \(tensor<([^>]*)>, tensor<([^>]*)>\) -> tensor<([^>]*)>"
)


def lowered_dot_dtypes(lowered_text: str) -> dict[str, int]:
    """'lhs x rhs -> out' element types of every dot the program asks for, before the backend
    rewrites any (XLA:CPU, for one, computes 16-bit and FP8 dots in fp32)."""
    counts: dict[str, int] = {}
    for lhs, rhs, out in _LOWERED_DOT.findall(lowered_text):
        key = " x ".join(t.rsplit("x", 1)[-1] for t in (lhs, rhs)) + " -> " + out.rsplit("x", 1)[-1]
        counts[key] = counts.get(key, 0) + 1
    return counts


def compiled_report(
    compiled: jax.stages.Compiled,
    *,
    num_devices: int,
    params: Any = None,
    advice: list[str] = (),
) -> dict[str, Any]:
    """Memory, FLOPs, GEMMs, collectives and advice of any compiled JAX program.

    ``params``: the parameters of a train step (arrays or ShapeDtypeStructs), to tell weight
    gradients from activation gradients; ``advice``: suggestions to list first.
    """
    gemms, collectives = hlo_lib.analyze(compiled.as_text(), num_devices=num_devices)
    weights = weight_sizes(params) if params is not None else None
    gemm_entries = [gemm_entry(g, weights) for g in gemms]
    per_device = sum(g.flops for g in gemms)
    roles: dict[str, int] = {}
    for entry in gemm_entries:
        roles[entry["role"]] = roles.get(entry["role"], 0) + entry["flops"]
    coll = [hlo_lib.to_dict(c) for c in collectives]
    return {
        "memory": budget.compiled_memory(compiled),
        "flops_per_step": per_device * num_devices,
        "flops_per_step_per_device": per_device,
        "gemm_flops_by_role_per_device": roles,
        "xla_cost_analysis_flops_per_device": _xla_flops(compiled),
        "gemms": gemm_entries,
        "collectives": coll,
        "collective_bytes_per_step": sum(c["bytes"] * c["count"] for c in coll),
        # What each device sends over its links per step (ring algorithms).
        "collective_wire_bytes_per_step_per_device": sum(
            c["wire_bytes"] * c["count"] for c in coll
        ),
        "advice": advise(gemm_entries, first=list(advice)),
    }


def inspect_config(
    config: Config, *, devices: list[jax.Device] | None = None, hlo_path: str | None = None
) -> dict[str, Any]:
    """The full report for the train step that ``config`` describes (compiled, never run)."""
    parts = build_components(config, devices=devices)
    traced = parts.trace_train_step()
    lowered = parts.lower_train_step(traced)
    compiled = lowered.compile()
    if hlo_path:
        with open(hlo_path, "w") as f:
            f.write(compiled.as_text())
    t, n = config.train, parts.mesh.size
    params = parts.abstract_state.params
    report = {
        "config": config.name,
        "workload": config.workload,
        "backend": jax.default_backend(),
        "device_kind": parts.mesh.devices.flat[0].device_kind,
        "mesh": dict(parts.mesh.shape),
        "precision": config.precision,
        "params": {
            "count": sum(x.size for x in jax.tree.leaves(params)),
            "bytes": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)),
        },
        **compiled_report(compiled, num_devices=n, params=params, advice=parts.workload.advice()),
        "model_flops_per_step": parts.model_flops_per_step,
        "examples_per_step": parts.workload.examples_per_step(t.batch_size),
        "examples_name": parts.workload.examples_name,
        "lowered_dot_dtypes": lowered_dot_dtypes(lowered.as_text()),
        "offload": {
            "state_bytes_per_device": offload.state_bytes_by_memory(parts.abstract_state),
            "activations_to_host_per_step": offload.host_transfers(traced.jaxpr),
        },
        "remat": config.remat.policy,
        "microbatches": t.microbatches,
    }
    # > 1 means the compiled step does work the model does not need (remat recompute).
    report["recompute_ratio"] = report["flops_per_step"] / report["model_flops_per_step"]
    return report


def format_table(report: dict[str, Any]) -> str:
    """A human-readable rendering of the report."""
    lines = [
        f"{report.get('config', '')}: {report.get('params', {}).get('count', 0):,} params, "
        f"mesh {report.get('mesh')}, {report.get('precision')}, {report.get('device_kind')}"
    ]
    for key, value in report["memory"].items():
        if value:
            lines.append(f"  memory {key:<22} {value / 2**20:10.2f} MiB")
    if "offload" in report:
        state = report["offload"]["state_bytes_per_device"]
        moved = report["offload"]["activations_to_host_per_step"]
        lines.append(
            f"  remat {report['remat']}, microbatches {report['microbatches']}; state per device: "
            + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in state.items())
            + f"; activations to host {moved['bytes'] / 2**20:.2f} MiB/step in {moved['count']}"
            " copies"
        )
    lines.append(
        f"  flops/step {report['flops_per_step']:.4g}  "
        f"model {report.get('model_flops_per_step', 0):.4g}  "
        f"recompute x{report.get('recompute_ratio', 1):.3f}"
    )
    lines.append(
        f"  {'layer':<34}{'role':<12}{'m':>7}{'n':>7}{'k':>7}{'batch':>6}{'x':>4}"
        f"{'GFLOP':>9}  dtype  eff128  findings"
    )
    for g in report["gemms"]:
        lines.append(
            f"  {g['layer'][:33]:<34}{g['role']:<12}{g['m']:>7}{g['n']:>7}{g['k']:>7}"
            f"{g['batch']:>6}{g['count']:>4}{g['flops'] / 1e9:>9.3f}  {g['dtypes'][0]:<6}"
            f"{g['efficiency_132sm']['128x128']:>6.2f}  {'; '.join(g['findings'])}"
        )
    for c in report["collectives"]:
        lines.append(
            f"  {c['kind']:<20} {c['dtype']:<5}{c['bytes'] / 2**20:10.3f} MiB x{c['count']} "
            f"group {c['group_size']}  sends {c['wire_bytes'] / 2**20:.3f} MiB  "
            f"{layer_of(c['op_name'])}"
        )
    if report["collectives"]:
        lines.append(
            f"  collectives/step: {report['collective_bytes_per_step'] / 2**20:.3f} MiB "
            f"buffers, {report['collective_wire_bytes_per_step_per_device'] / 2**20:.3f} MiB "
            f"sent per device"
        )
    lines.extend(f"  advice: {a}" for a in report["advice"])
    return "\n".join(lines)


def main(argv: list[str] | None = None, *, out: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(prog="python -m hopperjax.inspect", description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--hlo", metavar="PATH", help="also write the optimized HLO text here")
    parser.add_argument("--format", choices=("json", "table"), default="json")
    args = parser.parse_intermixed_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        # The compiled program depends on these flags, as in training.
        for line in xla_cpu.prepare_process(config):
            print(line, file=sys.stderr)
        report = inspect_config(config, hlo_path=args.hlo)
    except ConfigError as e:
        print(f"hopperjax: config error: {e}", file=sys.stderr)
        return 2
    out(json.dumps(report, indent=1) if args.format == "json" else format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
