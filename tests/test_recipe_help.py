"""Recipe help: `grpoflow recipe explain [KEY]` shows each recipe field's type, default, bounds and help from
the recipe dataclasses, and `docs/recipe.md` is the same table, generated, kept equal to the dataclasses
here."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import typing

import pytest

from conftest import REPO_ROOT
from flows import cli
from trainer import recipe as recipe_module
from trainer.recipe import Recipe, load_recipe
from trainer.recipe_help import GENERATOR, explain, recipe_fields, render_markdown, value_text
from trainer.typed_config import ConfigError

KEYS = [doc.key for doc in recipe_fields()]


def grpoflow(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


def test_docs_recipe_md_is_the_generated_table():
    written = (REPO_ROOT / "docs" / "recipe.md").read_text(encoding="utf-8")
    assert written == render_markdown(explain()), f"docs/recipe.md is out of date: run `{GENERATOR}`"


def leaf_fields(cls: type, prefix: str = "") -> list[str]:
    """Every field of the recipe dataclasses by dotted key, walked here independently of recipe_help."""
    keys, hints = [], typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.metadata.get("key", f.name)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        optional = [t for t in typing.get_args(hints[f.name]) if dataclasses.is_dataclass(t)]
        if dataclasses.is_dataclass(default):
            keys += leaf_fields(type(default), key + ".")
        elif key == "rewards":
            keys += [key] + leaf_fields(recipe_module.RewardSpec, "rewards[].")
        elif optional:  # off by default (model.lora: null), with settings of its own when set
            keys += [key] + leaf_fields(optional[0], key + ".")
        else:
            keys.append(key)
    return keys


def test_one_row_per_field_each_with_a_type_and_a_help_text():
    assert KEYS == leaf_fields(Recipe)
    rows = (REPO_ROOT / "docs" / "recipe.md").read_text(encoding="utf-8").splitlines()
    assert sorted(row.split("`")[1] for row in rows if row.startswith("| `")) == sorted(KEYS)
    for doc in recipe_fields():
        assert doc.type and doc.help, doc.key


def test_a_field_shows_its_type_default_bounds_and_help():
    [section] = explain("train.learning_rate")
    [doc] = section.fields
    assert (doc.key, doc.type, doc.default, doc.bounds) == ("train.learning_rate", "float", 1e-6, {"gt": 0})
    assert (doc.help, doc.default_text(), doc.bounds_text()) == (
        "peak learning rate (AdamW)",
        "1.0e-06",
        "> 0",
    )
    [doc] = explain("train.micro_batch_size")[0].fields
    assert (doc.default, doc.bounds_text()) == (32, ">= 1, <= 65,536")
    [doc] = explain("bootstrap.target_accuracy")[0].fields
    assert (doc.type, doc.default_text(), doc.bounds_text()) == (
        "list[float]",
        "[0.3, 0.6]",
        "each >= 0, <= 1",
    )
    [doc] = explain("train.loss_type")[0].fields
    assert (doc.type, doc.default_text()) == ('"grpo" | "bnpo" | "dr_grpo" | "dapo" | "cispo"', '"dapo"')
    [doc] = explain("rollout.async")[0].fields  # the YAML name, not the attribute `async_`
    assert (doc.type, doc.default_text()) == ("bool", "false")
    [doc] = explain("rollout.max_model_len")[0].fields
    assert (doc.type, doc.default_text(), doc.bounds_text()) == ("int | None", "null", ">= 1, <= 1,048,576")
    for key in ("rewards[].weight", "rewards[0].weight", "rewards.weight"):
        [doc] = explain(key)[0].fields
        assert (doc.key, doc.default) == ("rewards[].weight", 1.0)
    [doc] = explain("rewards")[0].fields[:1]
    assert doc.default == [
        {"name": "format", "weight": 0.5, "args": {}, "kind": "function", "endpoint": None},
        {"name": "accuracy", "weight": 1.0, "args": {}, "kind": "function", "endpoint": None},
    ]


def test_a_printed_default_loads_back_as_the_default():
    # Each default, pasted into a recipe as printed, gives the default recipe again; the settings inside an
    # off-by-default block (model.lora: null, rollout.env: null) would switch it on, and are pasted on their
    # own below.
    blocks = {"model.lora.": recipe_module.LoraConfig, "rollout.env.": recipe_module.EnvConfig}
    lines = [
        f"{doc.key}={value_text(doc.default)}"
        for doc in recipe_fields()
        if "[]" not in doc.key and not doc.key.startswith(tuple(blocks))
    ]
    entry_fields = len(dataclasses.fields(recipe_module.RewardSpec))
    block_fields = sum(len(dataclasses.fields(cls)) for cls in blocks.values())
    assert len(lines) == len(KEYS) - entry_fields - block_fields  # and not those of one `rewards` entry
    assert load_recipe(None, lines) == load_recipe(None)
    for prefix, cls in blocks.items():
        pasted = [
            f"{doc.key}={value_text(doc.default)}" for doc in recipe_fields() if doc.key.startswith(prefix)
        ]
        section, name = prefix.rstrip(".").split(".")
        assert getattr(getattr(load_recipe(None, [f"{section}.{name}={{}}"]), section), name) == cls()
        assert getattr(getattr(load_recipe(None, pasted), section), name) == cls()


def test_a_section_gives_its_fields_and_no_key_gives_every_field():
    [section] = explain("rollout")
    assert section.name == "rollout" and section.help
    assert [doc.key for doc in section.fields] == [k for k in KEYS if k.startswith("rollout.")]
    assert [doc.key for s in explain() for doc in s.fields] == KEYS
    assert [s.name for s in explain()] == [
        "",
        "model",
        "bootstrap",
        "data",
        "train",
        "rollout",
        "rewards",
        "eval",
        "registry",
    ]


@pytest.mark.parametrize(
    "key, closest",
    [
        ("train.learning_rat", "train.learning_rate"),
        ("rollout.asynch", "rollout.async"),
        ("trian", "train"),
        ("learning_rate", "train.learning_rate"),
    ],
)
def test_an_unknown_key_names_the_closest_valid_one(key, closest):
    with pytest.raises(ConfigError, match=f"unknown recipe key '{key}' \\(did you mean '{closest}'\\?\\)"):
        explain(key)


def test_every_field_explains_from_the_command_line(capsys):
    for key in KEYS:
        assert cli.main(["recipe", "explain", key, "--json"]) == 0, key
        fields = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["fields"]
        assert fields[0]["key"] == key and fields[0]["help"]
        assert (
            len(fields) == 1 or key == "rewards"
        )  # `rewards` is a field and the section of its entries' fields


def test_grpoflow_recipe_explain_as_a_user_runs_it():
    proc = grpoflow("recipe", "explain", "train.learning_rate")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        "[train] GRPO training: batch, loss, optimiser, checkpoints (TRL's GRPOConfig names)\n"
        "  train.learning_rate: float = 1.0e-06 (> 0)\n"
        "      peak learning rate (AdamW)\n"
    )

    proc = grpoflow("recipe", "explain")
    assert proc.returncode == 0, proc.stderr
    assert all(f"  {key}: " in proc.stdout for key in KEYS)

    proc = grpoflow("recipe", "explain", "rollout", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["key"] == "rollout" and [d["key"] for d in summary["fields"]] == [
        k for k in KEYS if k.startswith("rollout.")
    ]
    assert {"key", "section", "type", "default", "bounds", "bounds_text", "help"} == set(summary["fields"][0])

    proc = grpoflow("recipe", "explain", "--markdown")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (REPO_ROOT / "docs" / "recipe.md").read_text(encoding="utf-8")


def test_an_unknown_key_exits_2_naming_the_closest_key():
    proc = grpoflow("recipe", "explain", "train.learning_rat", "--json")
    assert proc.returncode == 2
    assert "did you mean 'train.learning_rate'?" in proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "error": "unknown recipe key 'train.learning_rat' (did you mean 'train.learning_rate'?); "
        "`grpoflow recipe explain` lists every key",
        "exit_code": 2,
    }
