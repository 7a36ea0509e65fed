"""The docs do not rot: every link resolves, every command names a script, module, config and keys
that exist, every Python block compiles (the front page's library example runs in
``tests/test_readme.py``). Reads the Markdown only; runs nothing."""

from __future__ import annotations

import importlib.util
import re
import shlex

import pytest
import yaml
from conftest import REPO

import hopperjax
from hopperjax.config import ConfigError
from hopperjax.data import datasets

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
COMMAND = re.compile(r"python3? (?:-m hopperjax(?:\.\w+)+|(?:tools|experiments)/\w+\.py)\b")
# A token that stands for something the reader fills in (FILE, R, [key=value ...], <dir>).
PLACEHOLDER = re.compile(r"[\[\]<>{}]|\.\.\.|^[A-Z][A-Z_0-9]*$|=[A-Z][A-Z_]*$|/X\.")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


def _code(text: str) -> list[str]:
    """Fenced blocks, 4-space indented blocks and inline code spans: the command-holding text."""
    blocks = [m.group(2) for m in FENCE.finditer(text)]
    prose = FENCE.sub("", text)
    blocks += re.findall(r"(?:^(?: {4}).*\n)+", prose, re.M)
    blocks += re.findall(r"`([^`\n]+)`", prose)
    # Inline spans may wrap over one line break in the prose.
    blocks += [s.replace("\n", " ") for s in re.findall(r"`([^`]+)`", prose) if "\n" in s]
    return blocks


def _commands(page) -> list[str]:
    found = []
    for block in _code(page.read_text()):
        lines = re.sub(r"\\\n\s*", " ", block).splitlines()
        for i, line in enumerate(lines):
            if line.startswith("$ ") and i + 1 < len(lines) and "error" in lines[i + 1]:
                continue  # a shell session showing what a mistake prints
            for m in COMMAND.finditer(line):
                command = line[m.start() :]
                for stop in (" #", " |", " &&", " >", " 2>", ";", "`"):
                    command = command.split(stop)[0]
                found.append(command.strip())
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(page):
    text = FENCE.sub("", page.read_text())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: link to {target}: no such file"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file), f"{page.name}: link to {target}: no such heading"


def test_every_page_is_linked_from_the_index():
    index = (REPO / "docs" / "README.md").read_text()
    for page in PAGES[1:]:
        if page.name != "README.md":
            assert f"({page.name})" in index, page.name


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_commands_name_what_exists(page):
    commands = _commands(page)
    for command in commands:
        try:
            tokens = shlex.split(command)
        except ValueError:
            tokens = command.split()
        where = f"{page.name}: `{command}`"
        target = tokens[2] if tokens[1] == "-m" else tokens[1]
        if tokens[1] == "-m":
            assert importlib.util.find_spec(target) is not None, f"{where}: no module {target}"
        else:
            assert (REPO / target).is_file(), f"{where}: no script {target}"
        if target == "hopperjax.data" and "prepare" in tokens:
            name = (tokens[tokens.index("prepare") + 1 :] or ["NAME"])[0]
            assert name == "NAME" or name in datasets.DATASETS, f"{where}: no dataset {name}"
        if "--config" not in tokens:
            continue
        config = tokens[tokens.index("--config") + 1]
        if PLACEHOLDER.search(config):
            continue
        assert (REPO / config).is_file(), f"{where}: no config {config}"
        overrides = [
            t for t in tokens
            if re.match(r"^[a-z_]+(\.[a-z_0-9]+)*=", t) and not PLACEHOLDER.search(t)
        ]  # fmt: skip
        # `key=a|b` offers alternatives: each is checked.
        for k, item in enumerate(overrides):
            key, _, value = item.partition("=")
            for choice in value.split("|")[1:]:
                overrides.append(f"{key}={choice}")
            overrides[k] = f"{key}={value.split('|')[0]}"
        for k in range(len(overrides)):
            try:
                hopperjax.load_config(REPO / config, overrides[: k + 1], validate_values=False)
            except ConfigError as e:
                pytest.fail(f"{where}: {e}")


def test_the_checks_see_the_commands():
    """The extraction is not vacuous: the pages' commands are found, in every form they take."""
    commands = [c for page in PAGES for c in _commands(page)]
    assert len(commands) > 70
    assert any(c.startswith("python experiments/nanogpt_parity.py") for c in commands)  # indented
    assert any("--config configs/dta_davis.yaml" in c for c in commands)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_python_blocks_compile(page):
    for m in FENCE.finditer(page.read_text()):
        if m.group(1) == "python":
            compile(m.group(2), str(page), "exec")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_multi_device_commands_say_how_to_get_the_devices_on_a_cpu(page):
    for block in _code(page.read_text()):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            if COMMAND.search(line) and re.search(r"mesh\.(data|fsdp|tensor)=([2-9]|\d\d)", line):
                assert "XLA_FLAGS=--xla_force_host_platform_device_count=" in line, (
                    f"{page.name}: `{line.strip()}` needs the fake-devices flag on a CPU"
                )


# Dotted names in the docs that are not config keys: the inspect report's fields, a placeholder.
NOT_KEYS = {"offload.activations_to_host_per_step", "offload.state_bytes_per_device", "model.x"}
FILE_SUFFIX = re.compile(r"\.(gz|txt|yaml|yml|py|md|json|png|csv|tsv|bin|jsonl|model)$")


def test_every_config_key_the_docs_name_exists():
    """A backticked ``group.key`` of a config group is a key of some workload's schema (so a
    renamed or removed key cannot linger in the docs)."""
    from hopperjax import config as config_lib
    from hopperjax import workloads

    known = {k for w in workloads.names() for k in config_lib.all_keys(workload=w)}
    groups = {k.split(".")[0] for k in known if "." in k}
    named = 0
    for page in PAGES:
        for span in re.findall(r"`([^`\n]+)`", FENCE.sub("", page.read_text())):
            for key in re.findall(r"(?<![\w./-])([a-z_][a-z_0-9]*(?:\.[a-z_0-9]+)+)(?==|\b)", span):
                if key.split(".")[0] not in groups or FILE_SUFFIX.search(key):
                    continue
                named += 1
                assert key in known or key in NOT_KEYS, f"{page.name}: `{span}`: no key {key}"
    assert named > 200  # the check sees the docs' keys


def _default_cell(text: str) -> object:
    """A defaults cell's literal: backticks and parentheticals dropped, YAML's scalars, numbers
    such as ``1e-3`` (a string to YAML 1.1) as floats."""
    text = text.strip().strip("`").strip()
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def test_the_cli_pages_defaults_are_the_codes():
    """docs/cli.md's key table states each key's default (the default workload's schema, no
    config file): a changed default cannot leave the table behind."""
    from hopperjax import config as config_lib

    tree = config_lib.to_dict(config_lib.load_config(None, validate_values=False))
    checked = 0
    for line in (REPO / "docs" / "cli.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if not line.startswith("| `") or len(cells) < 3 or "/" in cells[0] or "<" in cells[1]:
            continue  # not a key row, keys of alternatives (a / b), or a described default
        keys = re.findall(r"`([^`]+)`", cells[0])
        group = keys[0].rsplit(".", 1)[0] + "." if "." in keys[0] else ""
        keys = [keys[0], *(k if "." in k else group + k for k in keys[1:])]
        defaults = re.sub(r"\([^)]*\)", "", cells[1]).split(",")
        assert len(defaults) == len(keys), f"docs/cli.md: {cells[0]}: {len(keys)} keys, {cells[1]}"
        for key, cell in zip(keys, defaults, strict=True):
            node = tree
            for part in key.split("."):
                node = node[part]
            stated = _default_cell(cell)  # 1 == 1.0: an int cell matches a float default
            assert stated == node, (
                f"docs/cli.md: `{key}` default {cell.strip()}, the code's {node!r}"
            )
            checked += 1
    assert checked > 50  # the check sees the table
