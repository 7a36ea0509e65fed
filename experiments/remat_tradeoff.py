"""What each remat policy buys (memory) and costs (recompute, step time) on one model.

    python experiments/remat_tradeoff.py --config configs/quickstart.yaml [key=value ...]
        [--policies none,dots_no_batch,dots,save_names,offload,full] [--steps 20]
        [--out runs/remat_tradeoff]

For every policy: compiles the train step (per-device temporary and peak bytes from XLA's memory
analysis, GEMM FLOPs per step counted per loop trip, activation bytes the step copies to host
memory), then times ``--steps`` steps of the compiled step on batches already on the devices
(median). Writes ``table.md``, ``results.json`` and ``memory_vs_time.png``. ``save_names`` keeps
the qkv projection and MLP hidden activations; ``offload`` moves those two to pinned host memory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import plotting

import hopperjax
from hopperjax import xla_cpu
from hopperjax.memory import budget, offload
from hopperjax.observe import hlo
from hopperjax.trainer import build_components
from hopperjax.trainer.measure import measure_step_seconds

NAMED = {
    "save_names": ["remat.names=qkv,mlp_hidden"],
    "offload": ["remat.offload_names=qkv,mlp_hidden"],
}


def measure(config_path: str, overrides: list[str], policy: str, steps: int) -> dict:
    config = hopperjax.load_config(
        config_path, [*overrides, f"remat.policy={policy}", *NAMED.get(policy, [])]
    )
    parts = build_components(config)
    traced = parts.trace_train_step()
    compiled = parts.lower_train_step(traced).compile()
    memory = budget.compiled_memory(compiled)
    gemms, _ = hlo.analyze(compiled.as_text(), num_devices=parts.mesh.size)
    flops = sum(g.flops for g in gemms) * parts.mesh.size

    step_s = measure_step_seconds(config, steps=steps, parts=parts, compiled=compiled)
    return {
        "policy": policy,
        "temp_bytes": memory["temp_bytes"],
        "peak_bytes": memory["peak_estimate_bytes"],
        "flops_per_step": flops,
        "recompute": flops / parts.model_flops_per_step,
        "to_host_bytes": offload.host_transfers(traced.jaxpr)["bytes"],
        "step_ms": 1e3 * step_s,
    }


def write_table(rows: list[dict], header: str, path: Path) -> str:
    lines = [
        header,
        "",
        "| remat.policy | temp MiB/device | peak MiB/device | GFLOP/step | recompute "
        "| to host MiB/step | step ms (CPU) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['temp_bytes'] / 2**20:.2f} | {r['peak_bytes'] / 2**20:.2f} | "
            f"{r['flops_per_step'] / 1e9:.3f} | x{r['recompute']:.3f} | "
            f"{r['to_host_bytes'] / 2**20:.2f} | {r['step_ms']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot(rows: list[dict], path: Path) -> None:
    plt = plotting.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.scatter(r["step_ms"], r["temp_bytes"] / 2**20, s=40)
        ax.annotate(r["policy"], (r["step_ms"], r["temp_bytes"] / 2**20),
                    textcoords="offset points", xytext=(5, 4))  # fmt: skip
    ax.set_xlabel("step time, ms (median)")
    ax.set_ylabel("temporary memory per device, MiB")
    ax.set_title("remat policies: activation memory vs step time")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--policies", default="none,dots_no_batch,dots,save_names,offload,full")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="runs/remat_tradeoff")
    args = parser.parse_intermixed_args(argv)
    xla_cpu.prepare_script(args.config, args.overrides)  # its XLA flags, before JAX starts
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for policy in args.policies.split(","):
        rows.append(measure(args.config, args.overrides, policy.strip(), args.steps))
        print(f"{policy}: {rows[-1]['step_ms']:.1f} ms", file=sys.stderr, flush=True)
    header = (
        f"{args.config} {' '.join(args.overrides)} on {jax.device_count()} "
        f"{jax.devices()[0].device_kind} device(s)"
    )
    print(write_table(rows, header, out / "table.md"))
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "memory_vs_time.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
