"""Config schema: YAML + overrides, strict types, errors that name the key."""

import dataclasses

import pytest
import yaml
from conftest import REPO

import hopperjax
from hopperjax.config import ConfigError, dump_yaml, from_dict, load_config, to_dict


def _dotted(config, key):
    value = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_loads_and_shrinks(path, tmp_path):
    # Recipes on real data name ../shared/data paths; tests never read those, so such a recipe
    # gets a stand-in directory or file (loading checks only that the path is one).
    recipe = path.read_text()
    stand_in = []
    if "source: deepdta" in recipe:
        stand_in = [f"data.path={tmp_path}"]
    elif "source: text" in recipe:
        (tmp_path / "input.txt").write_text("stand-in text\n")
        stand_in = [f"data.path={tmp_path / 'input.txt'}"]
    as_written = load_config(path, stand_in)
    assert as_written.name == path.stem
    # The tiny CPU variant: the workload's own smoke overrides (TINY's model.* keys are GPT keys,
    # unknown to other workloads) and a short run.
    shrink = [*hopperjax.workloads.get(as_written.workload).smoke_overrides, "train.steps=20"]
    config = load_config(path, [*stand_in, *shrink])
    assert config.name == path.stem and config.workload == as_written.workload
    for item in shrink:
        key, _, raw = item.partition("=")
        assert _dotted(config, key) == yaml.safe_load(raw), key
    assert config.model != as_written.model and config.train.steps == 20


def test_overrides_parse_yaml_scalars():
    config = load_config(
        None,
        [
            "train.steps=7",
            "optim.base_lr=1e-3",
            "precision=bf16",
            "optim.clip_norm=null",
            "data.shuffle=false",
        ],
    )
    assert config.train.steps == 7
    assert config.optim.base_lr == pytest.approx(1e-3)
    assert config.precision == "bf16"
    assert config.optim.clip_norm is None
    assert config.data.shuffle is False


def test_yaml_string_floats_are_numbers(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  base_lr: 6e-4\n")  # YAML 1.1 reads this as a string
    assert load_config(path).optim.base_lr == pytest.approx(6e-4)


@pytest.mark.parametrize(
    ("override", "key", "fragment"),
    [
        ("trian.steps=5", "trian.steps", "unknown key 'trian.steps'; did you mean 'train.steps'?"),
        ("model.d_modle=64", "model.d_modle", "did you mean 'model.d_model'?"),
        ("workload=lmm", "workload", "unknown workload 'lmm'; did you mean 'lm'?"),
        # A dta model key is not a key of the lm workload's model group.
        (
            "model.head_dims=32",
            "model.head_dims",
            "unknown key 'model.head_dims' for workload 'lm' (a key of workload 'dta')",
        ),
        ("dta.filters=4", "dta.filters", "unknown key 'dta.filters'"),
        ("train.steps=many", "train.steps", "expected an integer"),
        ("train.steps=-5", "train.steps", "positive"),
        ("train.steps=2.5", "train.steps", "expected an integer"),
        ("precision=fp64", "precision", "expected one of fp32, tf32, bf16, fp16, fp8"),
        ("data.shuffle=maybe", "data.shuffle", "true or false"),
        ("model=3", "model", "mapping"),
        ("model.n_heads=3", "model.n_heads", "divide"),
        ("data.seq_len=4096", "data.seq_len", "model.max_len"),
        ("mesh.data=0", "mesh.data", "positive"),
        ("data.source=text", "data.path", "required"),
        ("data.source=text data.path=/nonexistent/x.txt", "data.path", "not found"),
        ("stepsonly", "stepsonly", "key=value"),
        ("distributed.coordinator_address=h:1", "distributed.coordinator_address", "num_processes"),
        (
            "distributed.coordinator_address=h:1 distributed.num_processes=2 "
            "distributed.process_id=2",
            "distributed.process_id",
            "expected 0 <= id < 2",
        ),
        ("mesh.data=4 mesh.dcn_data=3", "mesh.dcn_data", "must divide mesh.data=4"),
    ],
)
def test_bad_values_name_the_key(override, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs" / "quickstart.yaml", override.split())
    assert info.value.key == key
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_key_without_near_match_lists_nothing():
    with pytest.raises(ConfigError, match=r"unknown key 'zzzzzz'$"):
        load_config(None, ["zzzzzz=1"])


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("train:\n  steps: [1,\n")
    with pytest.raises(ConfigError, match=r"broken.yaml line \d+: invalid YAML"):
        load_config(path)


def test_missing_config_file():
    with pytest.raises(ConfigError) as info:
        load_config("/nonexistent/config.yaml")
    assert info.value.key == "--config"


def test_resolved_yaml_round_trips():
    config = load_config(REPO / "configs" / "quickstart.yaml", ["train.steps=3"])
    assert from_dict(yaml.safe_load(dump_yaml(config))) == config


def test_config_is_frozen_and_replace_validates():
    config = load_config(None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 3  # type: ignore[misc]
    assert config.replace(**{"train.steps": 9}).train.steps == 9
    with pytest.raises(ConfigError):
        config.replace(**{"train.steps": 0})


def test_defaults_live_in_schema():
    assert to_dict(load_config(None)) == to_dict(hopperjax.Config())
    assert hopperjax.Config(name="x").run_path.as_posix() == "runs/x"
