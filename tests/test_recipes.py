"""Every shipped recipe loads and validates; mistakes fail with the file, the key and the valid choices."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import REPO_ROOT, grpoflow_run, one_line_error
from trainer.recipe import Recipe, load_recipe
from trainer.rewards import resolve_reward
from trainer.typed_config import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_configs_exist():
    names = {p.stem for p in CONFIGS}
    assert {
        "tiny-cpu",
        "qwen2.5-7b-numina-8gpu",
        "countdown-qwen2.5-3b",
        "qwen2.5-vl-3b-clevr-counting",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_recipe_loads_and_its_rewards_resolve(path):
    recipe = load_recipe(path)
    assert isinstance(recipe, Recipe)
    assert recipe.name == path.stem
    for spec in recipe.rewards:
        assert callable(resolve_reward(spec.name, spec.args))


def test_reference_8gpu_recipe_matches_the_swift_run():
    r = load_recipe(Path(CONFIGS[0]).parent / "qwen2.5-7b-numina-8gpu.yaml")
    assert r.model.name_or_path == "Qwen/Qwen2.5-7B-Instruct"
    assert (r.train.num_generations, r.train.num_iterations, r.train.beta, r.train.learning_rate) == (
        24,
        4,
        0.001,
        7e-5,
    )
    assert r.rollout.train_devices == [0, 1, 2, 3, 4, 5] and r.rollout.rollout_devices == [6, 7]
    assert r.rollout.async_ is True and r.data.task == "numina"


def test_misspelled_key_names_file_key_and_suggestion(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  learnig_rate: 1.0e-4\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(bad)
    msg = str(e.value)
    assert str(bad) in msg and "train.learnig_rate" in msg and "did you mean 'learning_rate'" in msg
    assert "max_completion_length" in msg  # lists the valid keys


def test_unknown_section_and_wrong_types(tmp_path):
    cases = {
        "trian: {}\n": ("unknown key 'trian'", "did you mean 'train'"),
        "train:\n  max_steps: many\n": ("train.max_steps", "expected int, got str 'many'"),
        "train:\n  loss_type: ppo\n": ("train.loss_type", "'grpo', 'bnpo', 'dr_grpo', 'dapo'"),
        "rollout:\n  async: 'yes please'\n": ("rollout.async", "expected bool"),
        "rewards:\n  - {name: accuracy, wieght: 2}\n": ("rewards[0].wieght", "did you mean 'weight'"),
        "train:\n  num_generations: 1\n": ("train", "num_generations must be >= 2"),
        "rollout:\n  train_devices: [0, 1]\n  rollout_devices: [1, 2]\n": ("rollout", "in both"),
    }
    for text, expected in cases.items():
        path = tmp_path / "r.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError) as e:
            load_recipe(path)
        for part in expected:
            assert part in str(e.value), (text, str(e.value))


def test_warmup_below_one_is_a_fraction_of_the_updates_rounded_up_as_transformers_reads_it():
    def updates(*overrides: str) -> int:
        return load_recipe(None, list(overrides)).train.warmup_updates()

    assert updates("train.max_steps=1400", "train.warmup_steps=0.0714") == 100  # 99.96, rounded up
    assert updates("train.max_steps=200", "train.warmup_steps=0.0714") == 15  # 14.28
    assert updates("train.max_steps=6", "train.warmup_steps=0.0714") == 1  # 0.43: one update at the full rate
    assert updates("train.max_steps=10", "train.num_iterations=4", "train.warmup_steps=0.1") == 4  # of 40
    assert updates("train.max_steps=10", "train.warmup_steps=3") == 3
    assert updates("train.max_steps=10") == 0
    with pytest.raises(ConfigError, match="warmup_steps must be a whole number of updates.*got 2.5"):
        load_recipe(None, ["train.warmup_steps=2.5"])


def test_overrides_nested_keys_and_types():
    r = load_recipe(
        None,
        [
            "train.learning_rate=1e-4",
            "rollout.async=true",
            "data.limit=50",
            "train.epsilon_high=0.28",
            "data.hub_config=null",
        ],
    )
    assert r.train.learning_rate == 1e-4 and r.rollout.async_ is True and r.data.limit == 50
    assert r.train.epsilon_high == 0.28 and r.data.hub_config is None
    with pytest.raises(
        ConfigError, match="override 'train.learning_rate': expected key=value|expected key=value"
    ):
        load_recipe(None, ["train.learning_rate"])
    with pytest.raises(ConfigError, match="unknown key 'train.lr'"):
        load_recipe(None, ["train.lr=1"])


def test_defaults_have_one_source_and_round_trip():
    r = load_recipe(None)
    d = r.to_dict()
    assert d["rollout"]["async"] is False and d["train"]["loss_type"] == "dapo"
    from trainer.typed_config import build

    assert build(Recipe, d) == r


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_recipe(tmp_path / "nope.yaml")


def alias_bomb(levels: int) -> list[str]:
    """YAML mapping entries a0..a{levels-1}: nine strings, then each a list of nine aliases of the one before
    (under 600 bytes for 9 levels, 9**9 strings once expanded)."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return lines


def test_an_alias_bomb_is_refused_at_once_with_a_short_message_naming_the_file(tmp_path):
    """As reward arguments (every number in them is checked), as a value a message would show, and in an
    override; loaded in a fresh interpreter so that the wait for a refusal is bounded."""
    args = tmp_path / "args.yaml"
    args.write_text(
        "rewards:\n  - name: accuracy\n    args:\n" + "".join(f"      {x}\n" for x in alias_bomb(9))
    )
    shown = tmp_path / "shown.yaml"
    shown.write_text(
        "rewards:\n  - name: accuracy\n    args:\n"
        + "".join(f"      {x}\n" for x in alias_bomb(7))
        + "name: *a6\n"
    )
    override = "rewards=[{name: accuracy, args: {" + ", ".join(alias_bomb(9)) + "}}]"
    code = (
        "import sys\nfrom trainer.recipe import ConfigError, load_recipe\n"
        "for path, overrides in ((sys.argv[1], []), (sys.argv[2], []), (None, [sys.argv[3]])):\n"
        "    try:\n        load_recipe(path, overrides)\n        print('loaded')\n"
        "    except ConfigError as e:\n        print(str(e)[:1000].replace('\\n', ' '), len(str(e)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(args), str(shown), override],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 3, done.stdout
    # a5 (line 9 of each file) is the first node past the limit
    for line, source, where in zip(
        lines,
        (str(args), str(shown), "<defaults>: override 'rewards'"),
        ("line 9", "line 9", "line 1"),
        strict=True,
    ):
        message, length = line.rsplit(" ", 1)
        assert message.startswith(
            f"{source}: {where}: more than 100,000 values once its aliases are expanded"
        )
        assert int(length) < 300


def test_a_recursive_alias_is_refused_naming_the_file_and_line(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("rewards:\n  - name: accuracy\n    args: &args\n      again: *args\n")
    with pytest.raises(ConfigError, match=f"{path}: line 3: an alias refers to a node that contains it"):
        load_recipe(path)


def test_error_messages_show_a_bad_value_cut_short(tmp_path):
    long_list = json.dumps(list(range(10_000)))
    cases = {
        f"name: {long_list}\n": "name: expected str, got list [0, 1, 2, 3, 4, 5, 6, 7, ...]",
        f"train:\n  loss_type: {'x' * 5000}\n": "train.loss_type: 'xxxxxxxxxx",
        f"? {'y' * 5000}\n: 1\n": "unknown key 'yyyyyyyyyy",  # an explicit key: a plain one is 1024 at most
        f"rollout:\n  train_devices: [{', '.join(['-1'] * 5000)}]\n": (
            "rollout.train_devices[0]: must be >= 0, got -1"
        ),
        f"bootstrap:\n  target_accuracy: {[0] * 10_000}\n": (
            "target_accuracy must be [lo, hi], got [0.0, 0.0, 0.0"
        ),
    }
    for text, expected in cases.items():
        path = tmp_path / "r.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError) as e:
            load_recipe(path)
        assert expected in str(e.value), str(e.value)[:500]
        assert len(str(e.value)) < 400, str(e.value)[:500]
    with pytest.raises(ConfigError) as e:
        load_recipe(None, ["train.max_completion_length=" + "9" * 2000])
    assert "train.max_completion_length: must be <= 1,048,576, got 9999" in str(e.value)
    assert len(str(e.value)) < 300


def test_a_recipe_file_past_the_size_limit_is_refused_unread(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("name: big\n" + "#" * (1 << 20) + "\n")
    with pytest.raises(
        ConfigError, match=f"{path}: larger than 1,048,576 bytes, the most a recipe file may be"
    ):
        load_recipe(path)


@pytest.mark.parametrize(
    "key",
    [
        "bootstrap.sft_rows",
        "bootstrap.hidden_size",
        "bootstrap.vocab_size",
        "train.max_completion_length",
        "train.num_generations",
        "train.micro_batch_size",
        "rollout.max_model_len",
        "eval.max_tokens",
        "eval.repeats",
    ],
)
def test_numbers_that_size_memory_have_upper_bounds(key):
    with pytest.raises(ConfigError, match=f"<defaults> \\+ overrides: {key}: must be <= "):
        load_recipe(None, [f"{key}=1e30"])


@pytest.mark.parametrize("command", ["train", "run"])
def test_a_vision_recipe_loads_but_training_it_stops_at_start(tmp_path, command):
    """Until images reach vLLM, the 3B vision recipe (vLLM rollouts) must not generate from the questions
    alone."""
    config = REPO_ROOT / "configs" / "qwen2.5-vl-3b-clevr-counting.yaml"
    assert load_recipe(config).model.modality == "vision"  # the recipe itself still loads and validates
    extra = ["--state-dir", str(tmp_path / "state")] if command == "run" else []
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            command,
            "--config",
            str(config),
            *extra,
            f"data.out={tmp_path / 'data'}",
            f"train.output_dir={tmp_path / 'run'}",
            "--json",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "model.modality: vision trains with rollout.engine: transformers" in done.stderr
    assert "images do not reach the vllm engine" in done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["exit_code"] == 2
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()  # stopped before any work


# What each shipped recipe builds: where its processes go on its node, and what its rewards pay. Written from
# the YAML by hand, so a recipe edit or a change in how placement/rewards read it shows up here.
_TAGGED = "<think>work</think><answer>{}</answer>"
# no GPU, rollouts between updates in the trainer's own process (the first five fields of a build, below)
_CPU_IN_PROCESS = (0, "in-process", [None], [], None)
BUILDS = {
    # name: (gpus, mode, trainer CUDA_VISIBLE_DEVICES, rollout workers' masks, executor, rewards,
    #        task columns, (right answer, wrong answer), (reward of right, of wrong, of untagged wrong))
    "tiny-cpu": (  # its next batch sampled by one rollout worker process while the trainer steps
        0,
        "workers",
        [None],
        [None],
        None,
        {"format": 0.2, "accuracy": 1.0},
        {"answer": ["7"]},
        ("7", "8"),
        (1.2, 0.2, 0.0),
    ),
    "tiny-vl-counting-cpu": (
        *_CPU_IN_PROCESS,
        {"format": 0.2, "counting": 1.0},
        {"answer": ["3"]},
        ("3", "4"),
        (1.2, 0.2, 0.0),
    ),
    "qwen2.5-7b-numina-8gpu": (
        8,
        "workers",
        ["0,1,2,3,4,5,6,7"] * 6,
        ["6", "7"],
        None,
        {"accuracy": 1.0, "format": 1.0},
        {"answer": ["\\frac{1}{2}"]},
        ("1/2", "2"),
        (2.0, 1.0, 0.0),
    ),
    "qwen2.5-vl-3b-clevr-counting": (
        8,
        "workers",
        ["0,1,2,3,4,5,6,7"] * 6,
        ["6", "7"],
        None,
        {"counting": 1.0, "format": 1.0},
        {"answer": ["5"]},
        ("5", "6"),
        (2.0, 1.0, 0.0),
    ),
    "countdown-qwen2.5-3b": (
        8,
        "colocated",
        ["0,1,2,3,4,5,6,7"] * 8,
        [],
        "external_launcher",
        {"countdown": 1.0, "format": 0.1},
        {"nums": [[2, 3, 4]], "target": [14]},
        ("2 + 3 * 4", "2 + 3 + 4"),
        (1.1, 0.1, 0.0),
    ),
}
# LoRA changes what trains, not what it earns; its recipe samples between updates (async: false)
BUILDS["tiny-cpu-lora"] = (*_CPU_IN_PROCESS, *BUILDS["tiny-cpu"][5:])
# multi-turn recipes: their rewards read the final turn, as a single-turn one's do
BUILDS["tiny-tools-cpu"] = (
    *_CPU_IN_PROCESS,
    BUILDS["tiny-cpu"][5],
    {"answer": ["1776"]},
    ("1776", "1777"),
    (1.2, 0.2, 0.0),
)
BUILDS["qwen2.5-7b-tools-8gpu"] = (
    *BUILDS["qwen2.5-7b-numina-8gpu"][:5],
    {"accuracy": 1.0, "format": 0.5},
    {"answer": ["72"]},
    ("72", "71"),
    (1.5, 0.5, 0.0),
)
# node 0 of two: 4 trainer ranks, two tensor-parallel engines of 2 GPUs (node 1: test_gpu_semantics.py)
BUILDS["qwen2.5-32b-numina-2x8gpu"] = (
    8,
    "workers",
    ["0,1,2,3,4,5,6,7"] * 4,
    ["4,5", "6,7"],
    None,
    *BUILDS["qwen2.5-7b-numina-8gpu"][5:],
)


def test_every_shipped_recipe_has_its_builds_written_down():
    assert {p.stem for p in CONFIGS} == set(BUILDS)


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_what_each_recipe_builds(name):
    from trainer.placement import plan
    from trainer.rewards.runner import RewardRunner

    gpus, mode, trainer_masks, worker_masks, executor, weights, columns, answers, paid = BUILDS[name]
    recipe = load_recipe(REPO_ROOT / "configs" / f"{name}.yaml")
    placement = plan(recipe.rollout, gpus)
    assert placement.mode == mode and placement.executor == executor
    assert [p.cuda_visible_devices for p in placement.trainers] == trainer_masks
    # each trainer rank computes on its own device; each rollout worker on the one GPU it is given
    assert [p.device for p in placement.trainers] == (
        ["cpu"] if not gpus else [f"cuda:{r}" for r in range(len(trainer_masks))]
    )
    assert [p.cuda_visible_devices for p in placement.workers] == worker_masks
    assert all(p.device == ("cuda:0" if gpus else "cpu") for p in placement.workers)

    # the rewards, resolved and weighted as the trainer does (trainer/grpo.py), on a right, a wrong and an
    # untagged wrong completion
    assert {s.name: s.weight for s in recipe.rewards} == weights
    runner = RewardRunner([(s.name, resolve_reward(s.name, s.args), s.weight) for s in recipe.rewards])
    right, wrong = (_TAGGED.format(answer) for answer in answers)
    texts = [right, wrong, answers[1]]
    result = runner(["q"] * 3, texts, **{k: v * 3 for k, v in columns.items()})
    assert result.total == pytest.approx(list(paid), abs=1e-12)


# ==========================================================================================================
# Finite, in-range numbers everywhere in a recipe; exit 2 naming file and field
# ==========================================================================================================


def _float_fields():
    """(dotted key, field) of every float-typed field of the recipe, nested sections included."""
    import dataclasses
    import typing

    from trainer.recipe import Recipe
    from trainer.typed_config import yaml_key

    out = []
    for section in dataclasses.fields(Recipe):
        cls = typing.get_type_hints(Recipe)[section.name]
        if not dataclasses.is_dataclass(cls):
            continue
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]  # float, float | None, list[float]
            if tp is float or float in typing.get_args(tp):
                out.append(f"{section.name}.{yaml_key(f)}")
    return out


def test_every_float_of_the_recipe_refuses_nan_and_infinity():
    from trainer.recipe import load_recipe
    from trainer.typed_config import ConfigError

    keys = _float_fields()
    assert {
        "train.learning_rate",
        "train.temperature",
        "eval.temperature",
        "eval.request_timeout_s",
        "bootstrap.target_accuracy",
        "rollout.sync_timeout_s",
    } <= set(keys)
    for key in keys:
        for value in (".nan", ".inf", "-.inf"):
            override = f"{key}=[{value}, 0.5]" if key == "bootstrap.target_accuracy" else f"{key}={value}"
            with pytest.raises(ConfigError, match="must be a finite number") as e:
                load_recipe(REPO_ROOT / "configs" / "tiny-cpu.yaml", [override])
            assert key in str(e.value) and "tiny-cpu.yaml" in str(e.value)
    with pytest.raises(ConfigError, match=r"rewards\[0\].args.weight: must be a finite number"):
        load_recipe(None, ["rewards=[{name: accuracy, args: {weight: .nan}}]"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.learning_rate=-1", "train.learning_rate: must be > 0, got -1.0"),
        ("train.learning_rate=0", "train.learning_rate: must be > 0, got 0.0"),
        ("train.temperature=0", "train.temperature: must be > 0, got 0.0"),
        ("train.top_p=1.5", "train.top_p: must be <= 1, got 1.5"),
        ("train.beta=-0.1", "train.beta: must be >= 0, got -0.1"),
        ("train.max_grad_norm=-1", "train.max_grad_norm: must be >= 0, got -1.0"),
        ("train.reward_timeout_s=0", "train.reward_timeout_s: must be > 0, got 0.0"),
        ("train.max_steps=0", "train.max_steps: must be >= 1, got 0"),
        ("eval.temperature=-0.5", "eval.temperature: must be >= 0, got -0.5"),
        ("eval.limit=0", "eval.limit: must be >= 1, got 0"),
        ("eval.repeats=0", "eval.repeats: must be >= 1, got 0"),
        ("eval.request_timeout_s=0", "eval.request_timeout_s: must be > 0, got 0.0"),
        ("eval.max_tokens=0", "eval.max_tokens: must be >= 1, got 0"),
        ("rollout.gpu_memory_utilization=0", "rollout.gpu_memory_utilization: must be > 0, got 0.0"),
        ("rollout.train_devices=[0, -1]", "rollout.train_devices[1]: must be >= 0, got -1"),
        ("data.heldout=-0.1", "data.heldout: must be >= 0, got -0.1"),
        ("data.heldout=1.5", "heldout: 1.5 is neither a fraction in (0, 1) nor a whole number of rows"),
        ("bootstrap.target_accuracy=[0.3, 1.2]", "bootstrap.target_accuracy[1]: must be <= 1, got 1.2"),
    ],
)
def test_recipe_values_out_of_their_range_are_refused_naming_the_key(override, message):
    from trainer.recipe import load_recipe
    from trainer.typed_config import ConfigError

    with pytest.raises(ConfigError) as e:
        load_recipe(None, [override])
    assert message in str(e.value) and str(e.value).startswith("<defaults> + overrides")


def test_meaningful_edge_values_and_explicitly_non_finite_fields_are_accepted():
    from dataclasses import dataclass, field

    from trainer.recipe import load_recipe
    from trainer.typed_config import build

    r = load_recipe(
        None,
        [
            "eval.temperature=0",
            "train.max_grad_norm=0",
            "train.save_total_limit=0",
            "train.eval_heldout=0",
            "data.heldout=0",
            "data.heldout=3",
            "train.beta=0",
        ],
    )
    assert (r.eval.temperature, r.train.max_grad_norm, r.data.heldout) == (0.0, 0.0, 3.0)

    @dataclass
    class Bounds:
        ceiling: float = field(default=math.inf, metadata={"finite": False})

    assert math.isinf(build(Bounds, {"ceiling": float("inf")}).ceiling)


@pytest.mark.parametrize(
    "override, message",
    [
        ("eval.limit=0", "eval.limit: must be >= 1, got 0"),
        ("train.learning_rate=-1", "train.learning_rate: must be > 0, got -1.0"),
        ("train.temperature=.nan", "train.temperature: must be a finite number, got nan"),
        # the default recipe samples asynchronously: colocating asks for the other mode, and says so
        ("rollout.colocate=true", "nothing to overlap; set rollout.async=false to colocate"),
    ],
)
def test_recipe_input_errors_are_exit_2_naming_file_and_field(override, message, tmp_path):
    proc = grpoflow_run(
        "eval", str(tmp_path / "no-such-checkpoint"), override, "--state-dir", str(tmp_path / "s")
    )
    line = one_line_error(proc, "eval")
    assert message in line and "configs/tiny-cpu.yaml + overrides" in line


# ==========================================================================================================
# Generated overrides: applied, or refused naming the key (ConfigError; exit 2 from the CLI), never a crash
# ==========================================================================================================


def _recipe_keys(cls=None, prefix: str = "") -> dict[str, object]:
    """Every dotted key of the recipe and its type: its sections, and each field of each (nested sections
    included)."""
    import dataclasses
    import typing

    from trainer.typed_config import yaml_key

    cls = cls or Recipe
    keys = {}
    for f in dataclasses.fields(cls):
        key, tp = prefix + yaml_key(f), typing.get_type_hints(cls)[f.name]
        keys[key] = tp
        if dataclasses.is_dataclass(tp):
            keys |= _recipe_keys(tp, key + ".")
    return keys


# Values as a user types them (read as YAML): numbers at and past every edge, non-finite ones, other YAML
# types, YAML a recipe never holds, and text.
_OVERRIDE_VALUES = st.one_of(
    st.sampled_from(
        [
            *("0", "-1", "1", "2", "-0.0", "1e-320", "5e-324", "1e308", "1.8e308", "1e999", "-1e999"),
            *(".nan", ".inf", "-.inf", "nan", "inf", "9" * 400, "-" + "9" * 400, "9" * 5000, "2e64"),
            *(str(2**63), str(2**64), "0x1F", "0o17", "1_000", "true", "no", "null", "~", ""),
            *("[]", "{}", "[1, 2]", "[.nan]", "[" + "9" * 400 + "]", "{a: 1}", "{? [1]: 2}", "[" * 5000),
            *("!!binary aGk=", "!!python/name:os.system", "2024-01-01", "&a [*a]", "'quoted'", "{"),
            *('"\\ud800"', "a: b: c", "- x", "=", "1=2"),
        ]
    ),
    st.integers().map(str),
    st.floats().map(repr),
    st.text(max_size=20),
)
_OVERRIDE_KEYS = st.one_of(
    st.sampled_from(list(_recipe_keys())),
    st.sampled_from(["", ".", "train.", ".train", "train..seed", "no_such_section.x", "train.seed.x"]),
)


@given(key=_OVERRIDE_KEYS, value=_OVERRIDE_VALUES)
def test_generated_overrides_are_applied_or_refused_naming_the_key(key, value):
    try:
        recipe = load_recipe(REPO_ROOT / "configs" / "tiny-cpu.yaml", [f"{key}={value}"])
    except ConfigError as e:
        # the key, or the part of it that is wrong (an unknown section), or "empty key"
        assert "empty key" in str(e) or any(f"{part}" in str(e) for part in key.split(".") if part), str(e)
        return
    if _recipe_keys().get(key) in (str, str | None) and _reads_as_number(value):
        # a text field takes the text typed, not the number YAML reads in it ("1.10" is not "1.1")
        assert _dotted(recipe.to_dict(), key) == value.strip()


def _reads_as_number(text: str) -> bool:
    import yaml

    try:
        value = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError):
        return False
    return isinstance(value, int | float) and not isinstance(value, bool)


def _dotted(data: dict, key: str):
    for part in key.split("."):
        data = data[part]
    return data


# each example is a whole `grpoflow train --dry-run`: the recipe, its placement and its memory plan
@settings(max_examples=60)
@given(key=st.sampled_from(list(_recipe_keys())), value=_OVERRIDE_VALUES)
def test_generated_overrides_of_train_dry_run_exit_0_or_2_naming_the_key(key, value):
    import contextlib
    import io

    from flows.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["train", "--dry-run", "--json", f"{key}={value}"])
    assert code in (0, 2), err.getvalue()[-3000:]
    if code == 2:
        assert "Traceback" not in err.getvalue(), err.getvalue()[-3000:]
        error = json.loads(out.getvalue().strip().splitlines()[-1])["error"]
        assert key in error or key.rsplit(".", 1)[-1] in error or "memory plan" in error, error
