"""Workloads: what the generic trainer trains (``base.Workload``), picked by ``model.kind``."""

from __future__ import annotations

from hopperjax.config import Config
from hopperjax.workloads.base import Datasets, Field, Workload
from hopperjax.workloads.lm import LanguageModeling, cross_entropy


def get_workload(config: Config) -> Workload:
    if config.model.kind == "dta":
        from hopperjax.workloads.dta import AffinityRegression

        return AffinityRegression()
    return LanguageModeling()


__all__ = ["Datasets", "Field", "LanguageModeling", "Workload", "cross_entropy", "get_workload"]
