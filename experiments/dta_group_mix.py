"""What data.group_mix buys and costs: proteins per batch, table rows, model FLOPs per step.

    python experiments/dta_group_mix.py [--davis data/davis] [--mixes 1,2,4,8,16]

For Davis (if given) and a synthetic set of KIBA's shape (2,111 drugs, 229 proteins, 118,254
pairs), and each mix: the distinct proteins of the first 20 training batches of 2,048 pairs (mean
and min: how far from i.i.d. a batch is), the protein-table rows the step is compiled for (the
bound), and the model's FLOPs per step (``model_flops_per_step``, as the trainer's MFU counts
them). Nothing is trained or compiled.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import numpy as np

import hopperjax
from hopperjax import workloads
from hopperjax.data import ProcessShard

KIBA_SHAPE = [
    "data.source=synthetic",
    "data.path=null",
    "data.synthetic_drugs=2111",
    "data.synthetic_proteins=229",
    "data.synthetic_pairs=118254",
    "data.drug_max_len=100",
    "data.protein_max_len=1000",
    "data.pkd=false",
]


def measure(overrides: list[str], mix: int) -> dict[str, float]:
    config = hopperjax.load_config(
        "configs/dta_davis.yaml", [*overrides, f"data.group_mix={mix}", "run_dir=/tmp/unused"]
    )
    workload = workloads.from_config(config)
    datasets = workload.build_datasets(ProcessShard(0, 1))
    batch = config.train.batch_size
    proteins = [
        int(np.count_nonzero(np.unique(b["protein_index"]) >= 0))
        for b in itertools.islice(iter(datasets.train), 20)
    ]
    fields = workload.batch_fields(batch, datasets)
    return {
        "mix": mix,
        "proteins_mean": float(np.mean(proteins)),
        "proteins_min": min(proteins),
        "protein_rows": fields["protein_tokens"].shape[0],
        "gflop_per_step": workload.model_flops_per_step(batch, datasets) / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--davis", default=None)
    parser.add_argument("--mixes", default="1,2,4,8,16")
    args = parser.parse_args(argv)
    sets = [("KIBA-shaped synthetic", KIBA_SHAPE)]
    if args.davis:
        sets.insert(0, ("Davis", [f"data.path={args.davis}"]))
    print("| data | group_mix | proteins per batch (mean, min) | protein rows | GFLOP/step |")
    print("|---|---:|---:|---:|---:|")
    for name, overrides in sets:
        for mix in (int(m) for m in args.mixes.split(",")):
            r = measure(overrides, mix)
            print(
                f"| {name} | {mix} | {r['proteins_mean']:.1f}, {r['proteins_min']} | "
                f"{r['protein_rows']} | {r['gflop_per_step']:.1f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
