"""Config schema: YAML + overrides, strict types, errors that name the key."""

import dataclasses
import itertools

import pytest
import yaml
from conftest import REPO

import hopperjax
from hopperjax.config import MAX_MESSAGE, ConfigError, dump_yaml, from_dict, load_config, to_dict


def _dotted(config, key):
    value = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_loads_and_shrinks(path, tmp_path):
    # Recipes on real data name data/ paths (hopperjax.data prepare); tests never read those, so
    # such a recipe gets a stand-in directory or file (loading checks only that the path is one).
    recipe = path.read_text()
    stand_in = []
    if any(f"source: {s}" in recipe for s in ("deepdta", "folder", "files", "movielens", "criteo")):
        stand_in = [f"data.path={tmp_path}"]
    elif "source: text" in recipe:
        (tmp_path / "input.txt").write_text("stand-in text\n")
        stand_in = [f"data.path={tmp_path / 'input.txt'}"]
    as_written = load_config(path, stand_in)
    assert as_written.name == path.stem
    # The tiny CPU variant: the workload's own smoke overrides (TINY's model.* keys are GPT keys,
    # unknown to other workloads) and a short run.
    shrink = [*hopperjax.workloads.get(as_written.workload).smoke_overrides, "train.steps=20"]
    if "drug_encoder: gin" in recipe:  # the graph encoder's synthetic drugs must be real SMILES
        shrink.append("data.synthetic_smiles=true")
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


def _refused(path, overrides=()):
    """The ConfigError ``load_config`` raises; its message must be one short line."""
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    message = str(info.value)
    assert "\n" not in message and len(message) < 300, message
    return info.value


# A YAML alias bomb: anchor i is a list of 9 aliases of anchor h, ... down to a: 9**9 leaves.
BOMB = [f"&a [{', '.join('x' * 9)}]"] + [
    f"&{name} [{', '.join([f'*{prev}'] * 9)}]" for prev, name in itertools.pairwise("abcdefghi")
]


@pytest.mark.parametrize(
    "key",
    [
        "optim.base_lr",
        "optim.weight_decay",
        "optim.clip_norm",
        "loss_scale.factor",
        "loss_scale.init_scale",
        "model.dropout",
        "model.init_std",
    ],
)
@pytest.mark.parametrize("raw", ["nan", ".nan", "inf", "-.inf", "-inf", "1e400"])
def test_float_keys_refuse_nan_and_inf(key, raw, tmp_path):
    assert "finite" in str(_refused(None, [f"{key}={raw}"]))
    group, name = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{group}:\n  {name}: {raw}\n")
    assert _refused(path).key == key


@pytest.mark.parametrize(
    ("override", "key", "fragment"),
    [
        ("optim.b1=1.0", "optim.b1", "expected 0 <= b1 < 1"),
        ("optim.b1=-0.1", "optim.b1", "expected 0 <= b1 < 1"),
        ("optim.b2=1", "optim.b2", "expected 0 <= b2 < 1"),
        ("optim.momentum=1.5", "optim.momentum", "expected 0 <= momentum < 1"),
        ("optim.eps=0", "optim.eps", "positive"),
        ("optim.weight_decay=-0.1", "optim.weight_decay", ">= 0"),
        ("model.init_std=0", "model.init_std", "positive"),
        ("model.norm_eps=-1e-5", "model.norm_eps", "positive"),
        ("model.rope_theta=0", "model.rope_theta", "positive"),
        ("model.dropout=1.0", "model.dropout", "expected 0 <= dropout < 1"),
        ("loss_scale.factor=1", "loss_scale.factor", "expected > 1"),
        ("loss_scale.init_scale=0", "loss_scale.init_scale", "positive"),
        ("profile.start_step=-1", "profile.start_step", ">= 0"),
        ("profile.num_steps=-1", "profile.num_steps", ">= 0"),
        ("seed=-1", "seed", "expected 0 <= seed < 2**32"),
        ("seed=4294967296", "seed", "expected 0 <= seed < 2**32"),
        ("train.steps=2147483648", "train.steps", "fewer than 2**31 steps"),
        ("train.stop_after=2147483648", "train.stop_after", "fewer than 2**31 steps"),
        ("train.checkpoint_every=2147483648", "train.checkpoint_every", "2**31"),
        ("train.eval_every=2147483648", "train.eval_every", "2**31"),
        ("train.log_every=2147483648", "train.log_every", "2**31"),
        ("optim.warmup_steps=2147483648", "optim.warmup_steps", "2**31"),
        ("loss_scale.growth_interval=2147483648", "loss_scale.growth_interval", "2**31"),
        ("train.steps=99999999999999999999", "train.steps", "expected a 64-bit integer"),
        ("train.steps=0x" + "f" * 5000, "train.steps", "<20000-bit integer>"),
        ("train.steps=" + "9" * 5000, "train.steps", "expected an integer"),
        ("name=0x" + "f" * 5000, "name", "expected a string"),
    ],
)
def test_out_of_range_values_name_the_key(override, key, fragment):
    error = _refused(REPO / "configs" / "quickstart.yaml", [override])
    assert error.key == key
    assert fragment in str(error)


def test_seed_and_step_limits_are_inclusive_below():
    config = load_config(None, ["seed=4294967295", "train.steps=2147483647"])
    assert (config.seed, config.train.steps) == (2**32 - 1, 2**31 - 1)


COORDINATOR = "distributed.coordinator_address"
ONE_PROCESS = ["distributed.num_processes=1", "distributed.process_id=0"]


@pytest.mark.parametrize(
    ("address", "fragment"),
    [
        ("localhost", "expected host:port ([IPv6]:port), got 'localhost'"),
        ("localhost:", "expected a string"),  # YAML: a mapping
        (":1234", "expected host:port"),
        ("::1:1234", "expected host:port"),
        ("localhost:http", "expected host:port"),
        ("256.1.1.1:99999", "'256.1.1.1' is not an IPv4 address"),
        ("10.0.0:1234", "'10.0.0' is not an IPv4 address"),
        ("[::g]:1234", "'::g' is not an IPv6 address"),
        ("localhost:0", "expected a port in 1..65535, got '0'"),
        ("localhost:65536", "expected a port in 1..65535"),
        ("10.0.0.1:" + "9" * 5000, "expected a port in 1..65535"),
    ],
)
def test_bad_coordinator_addresses_are_refused(address, fragment):
    error = _refused(None, [f"{COORDINATOR}={address}", *ONE_PROCESS])
    assert error.key == COORDINATOR
    assert fragment in str(error)


@pytest.mark.parametrize(
    "address", ["localhost:1234", "10.0.0.1:8476", "[::1]:1234", "node-0.cluster.local:65535"]
)
def test_coordinator_addresses(address):
    config = load_config(None, [f"{COORDINATOR}={address}", *ONE_PROCESS])
    assert config.distributed.coordinator_address == address


def test_a_config_file_that_is_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\xe9\n".encode("latin-1"))
    error = _refused(path)
    assert error.key == "--config"
    assert str(error) == f"--config: {path}: not UTF-8 text (byte 9)"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("seed: 1\nseed: 2\n", "seed"),
        ("train:\n  steps: 5\n  batch_size: 8\n  steps: 6\n", "train.steps"),
        ("optim: {b1: 0.9, b1: 0.8}\n", "optim.b1"),
        # In a mapping an alias names, the key of its anchor.
        ("train: &t {steps: 5, steps: 6}\n", "train.steps"),
    ],
)
def test_a_key_given_twice_in_the_file_is_refused(text, key, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    error = _refused(path)
    assert error.key == key
    assert "given twice in" in str(error) and str(path) in str(error)


def test_a_key_given_twice_in_an_override_is_refused():
    error = _refused(None, ["model={n_layers: 1, n_layers: 2}"])
    assert error.key == "model.n_layers"
    assert "given twice in override" in str(error)


def test_merge_keys_may_be_overridden(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  <<: {steps: 5, batch_size: 8}\n  steps: 7\n")
    config = load_config(path)
    assert (config.train.steps, config.train.batch_size) == (7, 8)


def test_a_mapping_for_a_group_sets_its_keys_one_by_one():
    recipe = REPO / "configs" / "quickstart.yaml"
    base = load_config(recipe)
    config = load_config(recipe, ["model={n_layers: 1}", "train={steps: 5}"])
    assert config.model == dataclasses.replace(base.model, n_layers=1)
    assert config.train == dataclasses.replace(base.train, steps=5)
    assert config.replace(model={"d_model": 64}).model.n_layers == 1
    assert _refused(recipe, ["model={n_layers: 0}"]).key == "model.n_layers"
    assert _refused(recipe, ["train={stpes: 5}"]).key == "train.stpes"


@pytest.mark.parametrize(
    ("text", "key", "start"),
    [
        # The workload is read first, before the unknown keys a..i.
        (
            "".join(f"{a[1]}: {a}\n" for a in BOMB) + "workload: *i\n",
            "workload",
            "workload: expected a string, got [[[",
        ),
        ("".join(f"{a[1]}: {a}\n" for a in BOMB), "a", "unknown key 'a'"),
        ("seed:\n" + "".join(f"- {a}\n" for a in BOMB), "seed", "seed: expected an integer"),
        ("model:\n" + "".join(f"- {a}\n" for a in BOMB), "model", "model: expected a mapping"),
    ],
)
def test_an_alias_bomb_gets_a_short_message(text, key, start, tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    error = _refused(path)
    assert error.key == key
    assert str(error).startswith(start)


def test_recursive_and_deeply_nested_yaml_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: &m\n  x: *m\n")
    assert _refused(path).key == "model.x"
    assert _refused(None, ["seed=&a [*a]"]).key == "seed"
    assert _refused(None, ["seed=" + "[" * 1000]).key == "seed"  # deeper than the stack


def test_long_values_and_keys_are_cut_in_messages():
    error = _refused(None, ["precision=" + "y" * 1000])
    assert error.key == "precision" and "yyy...yyy" in str(error)
    error = _refused(None, ["z" * 1000])  # no '=': the key is the whole item
    assert error.key == "z" * 1000 and len(str(error)) < 150


def test_config_error_is_one_bounded_line():
    error = ConfigError("data.path", "file not found:\n" + "p" * 5000 + " (end)")
    assert "\n" not in str(error) and len(str(error)) <= MAX_MESSAGE
    assert str(error).startswith("data.path: file not found: ppp")
    assert str(error).endswith("pp (end)")


def test_a_config_built_in_python_is_checked_before_training(tmp_path):
    """The YAML path checks every choice as it reads it; a config changed in Python
    (``dataclasses.replace``) reaches ``train`` unread, so ``train`` validates it again: a
    misspelled choice, in a core group or a workload's model group, is one ConfigError naming its
    key, raised before the run directory is touched."""
    smoke = hopperjax.workloads.get("translation").smoke_overrides
    config = load_config(
        REPO / "configs" / "multi30k_t5.yaml", [*smoke, f"run_dir={tmp_path / 'run'}"]
    )
    bad_model = dataclasses.replace(config, model=dataclasses.replace(config.model, norm="lyaer"))
    bad_optim = dataclasses.replace(config, optim=dataclasses.replace(config.optim, name="adma"))
    for bad, key, expected in (
        (bad_model, "model.norm", "expected one of rms, layer, got 'lyaer'"),
        (bad_optim, "optim.name", "expected one of adamw, sgd, lamb, lars, got 'adma'"),
    ):
        with pytest.raises(ConfigError, match=expected) as e:
            hopperjax.train(bad, console=False)
        assert e.value.key == key
    assert not (tmp_path / "run").exists()
    # a None where the type allows one, and every choice the YAML path gives, pass as before
    hopperjax.config.validate(config)
