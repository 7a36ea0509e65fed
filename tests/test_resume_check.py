"""Which config changes a run directory with checkpoints refuses (``trainer/resume.py``): those
that change the train state's structure, named by key, before any array is read; the rest
resume."""

from __future__ import annotations

import pytest

import hopperjax
from hopperjax.config import ConfigError

# (override against an fp32 run, the key the refusal names, a fragment of the difference)
REFUSED = [
    # FP8 adds scale and amax-history variables to the state.
    ("precision=fp8", "precision", "this config's state has fp8."),
    # fp16 turns dynamic loss scaling on: a loss-scale state appears.
    ("precision=fp16", "precision", "loss_scale"),
    ("loss_scale.enabled=true", "loss_scale.enabled", "loss_scale"),
    # No clipping drops the clip transform's slot from the optimizer state.
    ("optim.clip_norm=null", "optim.clip_norm", "opt_state"),
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny fp32 run stopped at step 2, with its checkpoint."""
    path = tmp_path_factory.mktemp("resume") / "run"
    hopperjax.train(_config(path, "train.stop_after=2"), console=False)
    return path


def _config(run_dir, *overrides):
    from conftest import REPO, TINY

    return hopperjax.load_config(
        REPO / "configs" / "quickstart.yaml",
        [*TINY, f"run_dir={run_dir}", "train.checkpoint_every=2", *overrides],
    )


@pytest.mark.parametrize(("override", "key", "fragment"), REFUSED)
def test_a_change_of_the_states_structure_is_refused_by_key(run_dir, override, key, fragment):
    with pytest.raises(ConfigError) as info:
        hopperjax.train(_config(run_dir, override), console=False)
    assert info.value.key == key
    message = str(info.value)
    assert fragment in message and "use a new run_dir" in message, message


def test_changes_that_keep_the_structure_resume(run_dir, tmp_path):
    # bf16 compute keeps fp32 master weights and the same optimizer state: the state fits.
    result = hopperjax.train(
        _config(run_dir, "precision=bf16", "train.stop_after=3"), console=False
    )
    assert [r["step"] for r in result.history if "loss" in r] == [2]


def test_a_key_the_saved_config_lacks_counts_as_its_default(tmp_path):
    """A run written before a key existed resumes under today's schema: the absent key is its
    default (unchanged) unless this config sets another value; a key today's schema no longer
    knows is reported as changed (absent now)."""
    import yaml

    from hopperjax import config as config_lib
    from hopperjax.trainer.resume import changed_keys

    config = _config(tmp_path)
    tree = yaml.safe_load(config_lib.dump_yaml(config))
    del tree["optim"]["warmup_init_ratio"]  # as written before the key was added
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(tree))
    assert changed_keys(tmp_path, config) == {}
    assert changed_keys(tmp_path, _config(tmp_path, "optim.warmup_init_ratio=0.2")) == {
        "optim.warmup_init_ratio": (0.0, 0.2)
    }
    tree["optim"]["retired_key"] = 1  # a key since removed: the file is compared as written
    saved.write_text(yaml.safe_dump(tree))
    changed = changed_keys(tmp_path, config)
    assert changed == {
        "optim.retired_key": (1, "(absent)"),
        "optim.warmup_init_ratio": ("(absent)", 0.0),
    }
