"""Communication time per step on real links, from the compiled step's own collectives.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tools/comm_model.py \\
        --config configs/gpt_1b.yaml mesh.data=8 train.eval_batch_size=8 [key=value ...] \\
        [--schemes none,bf16,int8] [--links nvlink4,nvlink5,ib400] [--mfu 0.4] [--json]

For each ``comm.gradient_compression`` scheme the train step is compiled (nothing runs) and
``hopperjax.inspect`` lists its collectives. What each device sends per step is their buffers
times nccl-tests' ring factors; each collective takes ``sent / busbw`` of its kind on the link. A
link with ``devices`` other than the compiled mesh's (the 8-node ones: 64-way data parallelism)
rescales each collective of the full group to that many devices (the buffers stay: data
parallelism replicates the model; the factors grow towards 2 and 1).

Compute time is the step's FLOPs per device at ``--mfu`` of the link's GPU's dense bf16 peak (an
assumption, stated in the output). Step time is then bounded two ways:

- no overlap: compute + communication;
- overlap: XLA's fp32 all-reduce runs layer by layer inside the backward scan, so at best it
  hides behind the backward pass (2/3 of the compute): forward + max(backward, communication).
  The compressed reduction runs once, after the whole backward pass (it encodes every gradient
  at once), so nothing hides it: compute + communication either way.

Links (``LINKS``; busbw per GPU, one direction, the ideal nccl-tests' busbw approaches): NVLink 4
(8 H100 SXM, 450 GB/s), NVLink 5 (8 B200, 900 GB/s), PCIe 5 (8 H100 PCIe without NVLink,
~25 GB/s through the host's switches), and two 8-node clusters of H100s: a 400 Gb/s NIC per GPU
(rail-optimized: ring collectives at the node's 8 x 50 GB/s, all-to-all at one NIC's 50 GB/s
for the (n - 8)/n of its bytes that leave the node) and one 100 GbE NIC per node (12.5 GB/s
shared by 8 GPUs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import hopperjax
from hopperjax.config import ConfigError
from hopperjax.inspect import inspect_config
from hopperjax.observe.hlo import wire_factor


@dataclasses.dataclass(frozen=True)
class Link:
    name: str
    ring_gbps: float  # busbw of ring collectives (all-reduce, all-gather, reduce-scatter)
    all_to_all_gbps: float  # busbw of all-to-all (every GPU to every GPU: no ring to follow)
    peak_tflops: float  # the GPU's dense bf16 peak
    devices: int | None  # data-parallel ways it implies (None: the compiled mesh's)
    about: str

    def busbw(self, kind: str) -> float:
        return self.all_to_all_gbps if kind == "all-to-all" else self.ring_gbps


# Per GPU, one direction. Across nodes NCCL runs one ring per NIC (rail-optimized), so a ring
# collective's busbw is the node's NIC total shared by its GPUs; an all-to-all sends (n - g)/n of
# its bytes to other nodes through the GPU's own NIC: busbw = NIC x (n - 1)/(n - g), g GPUs a node.
LINKS = {
    "nvlink4": Link("nvlink4", 450.0, 450.0, 989.0, None, "8 H100 SXM, NVLink 4 / NVSwitch"),
    "nvlink5": Link("nvlink5", 900.0, 900.0, 2250.0, None, "8 B200, NVLink 5 / NVSwitch"),
    "pcie5": Link("pcie5", 25.0, 25.0, 756.0, None, "8 H100 PCIe, no NVLink bridge"),
    "ib400": Link(
        "ib400", 400.0, 50.0 * 63 / 56, 989.0, 64, "8 nodes x 8 H100, a 400 Gb/s NIC per GPU"
    ),
    "eth100": Link(
        "eth100", 12.5, 12.5 / 8 * 63 / 56, 989.0, 64, "8 nodes x 8 H100, one 100 GbE NIC a node"
    ),
}
BACKWARD_SHARE = 2 / 3  # of a step's FLOPs: two GEMMs of three per weight


def comm_seconds(report: dict, link: Link) -> tuple[float, float]:
    """(bytes each device sends per step, seconds they take on ``link``); collectives over the
    whole mesh rescaled to ``link.devices`` ways when it sets them."""
    mesh_size = report["devices"]
    sent = seconds = 0.0
    for c in report["collectives"]:
        n = c["group_size"]
        if link.devices is not None and n == mesh_size:
            n = link.devices
        wire = wire_factor(c["kind"], n) * c["bytes"] * c["count"]
        sent += wire
        seconds += wire / (link.busbw(c["kind"]) * 1e9)
    return sent, seconds


def model_rows(reports: dict[str, dict], links: list[Link], mfu: float) -> list[dict]:
    rows = []
    for link in links:
        for scheme, report in reports.items():
            sent, comm = comm_seconds(report, link)
            compute = report["flops_per_step_per_device"] / (link.peak_tflops * 1e12 * mfu)
            serial = compute + comm
            if scheme == "none":
                backward = BACKWARD_SHARE * compute
                overlapped = compute - backward + max(backward, comm)
            else:
                overlapped = serial
            rows.append(
                {
                    "link": link.name,
                    "devices": link.devices or report["devices"],
                    "scheme": scheme,
                    "sent_mib": sent / 2**20,
                    "comm_ms": comm * 1e3,
                    "compute_ms": compute * 1e3,
                    "step_ms_no_overlap": serial * 1e3,
                    "step_ms_overlap": overlapped * 1e3,
                }
            )
    return rows


def format_table(rows: list[dict], mfu: float) -> str:
    lines = [
        f"compute at {mfu:.0%} of the GPU's dense bf16 peak; bandwidths per GPU, one direction",
        "| link | devices | compression | MiB sent/device/step | comm ms | compute ms | "
        "step ms, no overlap | step ms, overlap |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['link']} | {r['devices']} | {r['scheme']} | {r['sent_mib']:,.0f} | "
            f"{r['comm_ms']:.1f} | {r['compute_ms']:.1f} | {r['step_ms_no_overlap']:.1f} | "
            f"{r['step_ms_overlap']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/comm_model.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--schemes", default="none,bf16,int8")
    parser.add_argument("--links", default=",".join(LINKS))
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed compute efficiency")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_intermixed_args(argv)
    unknown = [name for name in args.links.split(",") if name not in LINKS]
    if unknown:
        parser.error(f"--links: unknown {', '.join(unknown)}; choose from {', '.join(LINKS)}")
    if not 0 < args.mfu <= 1:
        parser.error("--mfu: expected a fraction in (0, 1]")
    links = [LINKS[name] for name in args.links.split(",")]
    reports = {}
    try:
        for scheme in args.schemes.split(","):
            config = hopperjax.load_config(
                args.config, [*args.overrides, f"comm.gradient_compression={scheme}"]
            )
            reports[scheme] = inspect_config(config)
            reports[scheme]["devices"] = config_devices(reports[scheme])
    except ConfigError as e:
        print(f"hopperjax: config error: {e}", file=sys.stderr)
        return 2
    rows = model_rows(reports, links, args.mfu)
    print(json.dumps(rows, indent=1) if args.json else format_table(rows, args.mfu))
    return 0


def config_devices(report: dict) -> int:
    mesh = report["mesh"]
    return mesh["data"] * mesh["fsdp"] * mesh["tensor"]


if __name__ == "__main__":
    sys.exit(main())
