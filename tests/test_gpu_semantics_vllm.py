"""What a GPU changes for the vLLM rollout path, checked on CPU: a colocated engine whose level-2 sleep
discards its weights, the in-process engine's weight load under ZeRO-3's group-by-group gather, the vLLM API
range the engine accepts, and the install hints and attention fallback a GPU user meets.

vLLM's CPU build cannot sleep, so the sleep test emulates that one GPU behaviour with an engine of its own
(its name says so); the weight-load and API-range tests run the real vLLM CPU build in its venv
(`make install-vllm`, which `make test` builds first) through a subprocess, since this suite's venv has none.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from conftest import REPO_ROOT, clean_env
from trainer.grpo import GRPOTrainer
from trainer.logprobs import completion_logps
from trainer.model_loading import load_model
from trainer.recipe import ModelConfig, load_recipe
from trainer.rollout.hf_engine import HFEngine

_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"


def _vllm_recipe(tmp_path: Path, tiny_base: dict, data: Path, *overrides: str):
    return load_recipe(
        REPO_ROOT / "configs" / "tiny-cpu.yaml",
        [
            f"bootstrap.out={tiny_base['path']}",
            f"data.out={data}",
            f"train.output_dir={tmp_path / 'run'}",
            "train.prompts_per_step=2",
            "train.num_generations=4",
            "train.eval_heldout=4",
            "train.micro_batch_size=8",
            "train.max_completion_length=8",
            "train.learning_rate=1e-3",
            *overrides,
        ],
    )


class _vllm_EmulatedLevelTwoSleepEngine:
    """Emulates vLLM's GPU sleep at level 2 over a transformers model of its own (vLLM's CPU build cannot
    sleep): `sleep(2)` discards the weights (zeroes them: a GPU engine's freed and re-allocated weight memory
    holds nothing of them), and `generate` raises until `update_weights` sends them again, as `VLLMEngine`
    does. Sleep level 1 keeps them."""

    def __init__(self, path: str):
        model, tokenizer = load_model(path, ModelConfig(dtype="float32"))
        self.inner = HFEngine(model.eval(), tokenizer)
        self.asleep: set[str] = set()
        self.weights_lost = False
        self.loads: list[int] = []

    @property
    def version(self) -> int:
        return self.inner.version

    def generate(self, prompts, n, sampling):
        if self.asleep:
            raise RuntimeError(f"the engine is asleep ({sorted(self.asleep)}); call wake_up() first")
        if self.weights_lost:
            raise RuntimeError(
                "sleep(level=2) discarded the weights; call update_weights() before generating"
            )
        return self.inner.generate(prompts, n, sampling)

    def update_weights(self, named_tensors, version: int) -> None:
        if "weights" in self.asleep:
            raise RuntimeError("the weights are asleep; call wake_up(['weights']) before update_weights()")
        held = self.inner.model.state_dict()  # every checkpoint name, a tied lm_head included, as vLLM takes
        with torch.no_grad():
            for name, tensor in named_tensors:
                held[name].copy_(tensor)
        self.inner.version = version
        self.weights_lost = False
        self.loads.append(version)

    @torch.no_grad()
    def sleep(self, level: int = 1) -> None:
        self.asleep = {"weights", "kv_cache"}
        if level >= 2:
            for p in self.inner.model.parameters():
                p.zero_()
            self.weights_lost = True

    def wake_up(self, tags=None) -> None:
        self.asleep = set() if tags is None else self.asleep - set(tags)


def test_colocated_engine_with_emulated_gpu_sleep_level_two_gives_trainer_logprobs_at_every_step(
    tmp_path, tiny_base, tiny_data, monkeypatch
):
    """Colocated, sleep_level 2: the held-out evaluation at version 0 puts the engine to sleep, which
    discards its weights; step 0 (same version) and step 1 must still generate with the trainer's policy."""
    recipe = _vllm_recipe(tmp_path, tiny_base, tiny_data, "rollout.colocate=true", "rollout.sleep_level=2")
    engine = _vllm_EmulatedLevelTwoSleepEngine(tiny_base["path"])
    monkeypatch.setattr("trainer.grpo.make_engine", lambda *a, **k: engine)
    trainer = GRPOTrainer(recipe, tiny_base["path"], tiny_data, progress=False)
    trainer.setup()
    assert trainer.local_engine.engine is engine
    assert trainer.evaluate_heldout()  # version 0; the engine sleeps at level 2 afterwards
    assert engine.weights_lost
    source = trainer.rollout_source()
    for step in range(2):
        batch, _ = source.next(step)
        assert engine.weights_lost and engine.loads[-1] == trainer.version == step
        mb = batch.micro_batch(torch.arange(len(batch)), trainer.tokenizer.pad_token_id)
        with torch.no_grad():
            trainer_logps, _ = completion_logps(
                trainer.model, mb, recipe.train.temperature, share_prompts=True
            )
        mask = mb.completion_mask > 0
        assert torch.allclose(trainer_logps[mask], mb.behaviour_logps[mask], atol=1e-4), f"step {step}"
        batch.advantages = torch.linspace(-1, 1, len(batch))  # the next step samples a moved policy
        trainer.optimize(batch)


def test_flash_attention_recipe_loads_with_sdpa_and_a_warning_where_flash_attn_is_not_installed(
    tiny_base, caplog
):
    """The 7B recipe asks for flash_attention_2, which no extra installs (flash-attn is compiled for the
    machine's torch and CUDA): without the package the model loads with PyTorch's sdpa, and says so."""
    import importlib.util

    import trainer.model_loading

    assert importlib.util.find_spec("flash_attn") is None, "this check needs a Python without flash-attn"
    recipe = load_recipe(REPO_ROOT / "configs" / "qwen2.5-7b-numina-8gpu.yaml")
    assert recipe.model.attn_implementation == "flash_attention_2"
    model, _ = load_model(tiny_base["path"], ModelConfig(attn_implementation="flash_attention_2"))
    assert model.config._attn_implementation == "sdpa"
    choose = trainer.model_loading.attention_implementation
    choose.cache_clear()  # it warns once per process: an earlier load in this one may have warned already
    with caplog.at_level(logging.WARNING, logger="grpoflow.model_loading"):
        assert choose("flash_attention_2") == "sdpa"
    assert "flash_attention_2" in caplog.text and "'flash_attn'" in caplog.text and "sdpa" in caplog.text
    assert choose("eager") == "eager"  # what needs no missing package passes through


def test_install_hints_name_only_extras_that_pyproject_defines():
    """Every `pip install '.[extra]'` the code tells a user to run names an extra pyproject.toml has."""
    extras = set(
        tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    named = {}
    for path in sorted((REPO_ROOT / "trainer").rglob("*.py")) + sorted((REPO_ROOT / "flows").rglob("*.py")):
        for extra in re.findall(r"\.\[([A-Za-z0-9_,-]+)\]", path.read_text()):
            for name in extra.split(","):
                named.setdefault(name, []).append(str(path.relative_to(REPO_ROOT)))
    assert named, "no install hint found: the pattern no longer matches how hints are written"
    unknown = {name: files for name, files in named.items() if name not in extras}
    assert not unknown, f"install hints name extras pyproject.toml does not define: {unknown}"


# ---- the real vLLM (CPU build), in its own venv ------------------------------------------------------------

_VLLM_GROUP = 4  # tensors per gathered group in the streamed load below
_VLLM_STREAMED_LOAD = """
import gc, json, sys, weakref
import torch
from trainer.model_loading import load_model
from trainer.recipe import ModelConfig
from trainer.rollout.base import SamplingParams
from trainer.rollout.vllm_engine import VLLMEngine, reload_takes_tensors
from trainer.logprobs import completion_logps
from trainer.rollout.batch import RolloutBatch

path, group = sys.argv[1], int(sys.argv[2])
engine = VLLMEngine(path, dtype="float32", seed=0, enforce_eager=True, max_model_len=64)
model, tokenizer = load_model(path, ModelConfig(dtype="float32"))
gen = torch.Generator().manual_seed(7)
with torch.no_grad():  # the trainer's policy after an update: what the engine must hold after the load
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * 0.02)
state = list(model.state_dict().items())
made, alive_peak = [], 0

def gathered_copies():
    # ZeRO-3's gather by its effect (deepspeed_setup._gather_group): each group copied out whole, then
    # yielded; before each new group, count the copies of earlier groups the engine still holds
    global alive_peak
    for start in range(0, len(state), group):
        gc.collect()
        alive_peak = max(alive_peak, sum(r() is not None for r in made))
        copies = [(name, t.detach().clone()) for name, t in state[start : start + group]]
        made.extend(weakref.ref(t.untyped_storage()) for _, t in copies)  # views (detach) keep it alive
        yield from copies
        del copies

engine.update_weights(gathered_copies(), version=1)
gc.collect()
prompts = [tokenizer("12+34=")["input_ids"], tokenizer("7+8=")["input_ids"]]
groups = engine.generate(prompts, 2, SamplingParams(max_tokens=6, temperature=1.0, seed=3))
completions = [c for g in groups for c in g]
rows = [p for p, g in zip(prompts, groups) for _ in g]
batch = RolloutBatch(rows, completions, torch.zeros(len(rows)), torch.ones(len(rows)))
mb = batch.micro_batch(torch.arange(len(rows)), tokenizer.pad_token_id)
with torch.no_grad():
    ours, _ = completion_logps(model.eval(), mb, 1.0)
print(json.dumps({
    "vllm": engine.vllm_version,
    "path": engine.weight_load_path,
    "workers_take_tensors": engine.llm.collective_rpc(reload_takes_tensors),
    "tensors": len(state),
    "layer_tensors": sum(name.startswith("model.layers.0.") for name, _ in state),
    "alive_peak": alive_peak,
    "alive_after": sum(r() is not None for r in made),
    "versions": sorted({c.policy_version for c in completions}),
    "logp_gap": float(((ours - mb.behaviour_logps).abs() * mb.completion_mask).max()),
}))
"""


def _vllm_python() -> str:
    """This Python when it has vLLM (the vLLM suite), else the vLLM venv's, which `make test` builds first."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    if not _VLLM_PYTHON.exists():
        pytest.fail(f"{_VLLM_PYTHON} not found: `make install-vllm` makes the vLLM venv", pytrace=False)
    return str(_VLLM_PYTHON)


@pytest.fixture(scope="module")
def _vllm_streamed_load(tiny_base) -> dict:
    """A real in-process `VLLMEngine` on the tiny model, loaded from a stream of ZeRO-3-style gathered groups,
    then generating (one subprocess of the vLLM venv, about a minute on 2 cores)."""
    proc = subprocess.run(
        [_vllm_python(), "-c", _VLLM_STREAMED_LOAD, tiny_base["path"], str(_VLLM_GROUP)],
        cwd=REPO_ROOT,
        env=clean_env({"VLLM_CPU_KVCACHE_SPACE": "1"}),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_in_process_vllm_engine_loads_zero3_gathered_groups_one_at_a_time(_vllm_streamed_load):
    """`update_weights` hands vLLM the gathered tensors as they come: while a group is gathered, the engine
    holds about one layer's worth of the earlier groups (vLLM's layerwise reload keeps a layer's
    tensors until the layer is complete), never the whole model; and it loaded the trainer's policy."""
    r = _vllm_streamed_load
    assert r["tensors"] > 4 * _VLLM_GROUP, r
    # a list of all holds every earlier copy at the last group (measured: 48 of 51 tensors; streamed: 4)
    assert r["alive_peak"] <= r["layer_tensors"] < r["tensors"] - 2 * _VLLM_GROUP, r
    assert r["alive_after"] == 0, r
    assert r["versions"] == [1] and r["logp_gap"] < 1e-4, r


def test_installed_vllm_takes_tensors_through_reload_weights(_vllm_streamed_load):
    """The engine asks the installed vLLM's own workers whether their `reload_weights` takes tensors by
    keyword, and uses that path (vllm-cpu 0.32 has it)."""
    r = _vllm_streamed_load
    assert r["workers_take_tensors"] == [True] and r["path"] == "reload_weights", r


class _vllm_OldRunner:
    """Stands in for vLLM 0.12's classes, which cannot be installed beside 0.32: only the signature matters,
    `Worker.reload_weights(self)` (reloads the checkpoint from disk, takes no tensors)."""

    def reload_weights(self) -> None:
        raise AssertionError("not called: only its signature is read")


class _vllm_OldWorker(_vllm_OldRunner):
    model_runner = _vllm_OldRunner()


class _vllm_NewWorker:
    """vLLM 0.32's shape: the worker forwards everything to its runner, whose signature decides."""

    class model_runner:  # noqa: N801 - an attribute standing for an instance
        @staticmethod
        def reload_weights(weights_iterator=None, weights_path=None, is_checkpoint_format=True):
            raise AssertionError("not called")

    def reload_weights(self, *args, **kwargs):
        raise AssertionError("not called")


def test_vllm_without_keyword_reload_weights_falls_back_to_apply_model_or_is_refused_naming_its_version():
    from trainer.rollout.vllm_engine import reload_takes_tensors, weight_load_path

    assert reload_takes_tensors(_vllm_NewWorker()) is True
    assert reload_takes_tensors(_vllm_OldWorker()) is False

    class WithApplyModel:
        def apply_model(self, func):
            raise AssertionError("not called")

    assert weight_load_path([True], WithApplyModel(), "0.32.0") == "reload_weights"
    assert weight_load_path([False], WithApplyModel(), "0.12.0") == "apply_model"
    with pytest.raises(RuntimeError) as refused:
        weight_load_path([False], object(), "0.9.2")
    message = str(refused.value)
    assert "vLLM 0.9.2" in message and "reload_weights(weights_iterator=" in message
    extra = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (requirement,) = extra["vllm"]
    assert all(bound in message for bound in re.findall(r"[<>=]=?[0-9.]+", requirement)), message
