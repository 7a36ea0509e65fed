"""One process of the two-process test: what the CLI does, then prints its losses as JSON.

Run as ``python tests/two_process_worker.py PROCESS_ID PORT RUN_DIR [key=value ...]``.
"""

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")  # the test sets it
os.environ["JAX_PLATFORMS"] = "cpu"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import hopperjax  # noqa: E402

process_id, port, run_dir, *overrides = sys.argv[1:]
config = hopperjax.load_config(
    os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.yaml"),
    [
        *overrides,
        f"run_dir={run_dir}",
        f"distributed.coordinator_address=127.0.0.1:{port}",
        "distributed.num_processes=2",
        f"distributed.process_id={process_id}",
        "distributed.initialization_timeout_s=60",
    ],
)
hopperjax.initialize_distributed(config.distributed)
result = hopperjax.train(config, console=False)
losses = {r["step"]: r["loss"] for r in result.history if "loss" in r}
print(
    json.dumps(
        {
            "process": jax.process_index(),
            "devices": jax.device_count(),
            "local_devices": jax.local_device_count(),
            "losses": losses,
        }
    )
)
