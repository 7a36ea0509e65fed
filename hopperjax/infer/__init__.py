"""Inference: a run's parameters without its optimizer or data (``restore``)."""

from hopperjax.infer.restore import Restored, restore_params

__all__ = ["Restored", "restore_params"]
