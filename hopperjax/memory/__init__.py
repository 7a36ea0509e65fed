"""Memory: activation remat policies, host offload, the compile-only batch finder, and the host
heap setting that keeps XLA:CPU's per-step buffers resident (``host_heap``)."""

from hopperjax.memory.offload import HOST_MEMORY, check_host_memory, state_bytes_by_memory
from hopperjax.memory.remat import checkpoint_policy, remat_block

__all__ = [
    "HOST_MEMORY",
    "check_host_memory",
    "checkpoint_policy",
    "remat_block",
    "state_bytes_by_memory",
]
