"""What a GPU run changes in precision and weight sync, checked on CPU: one bf16 step at a small learning rate
moves the weights as a float32 step does (single process and two gloo DDP ranks), and the weight sync to
rollout workers is bounded by its timeout, picks its transport by device and reports its bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch

from conftest import REPO_ROOT
from trainer.grpo import GRPOTrainer
from trainer.recipe import load_recipe

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
from trainer.launch import leave_distributed; leave_distributed()
"""


def _sync_step(
    tmp_path: Path, model: str, batch: Path, ranks: int, *overrides: str
) -> dict[str, torch.Tensor]:
    """The update of `batch` by `ranks` trainer processes (gloo DDP when 2), launched as torchrun does."""
    script, out = tmp_path / "one_step.py", tmp_path / f"update-{len(list(tmp_path.glob('update-*')))}.pt"
    script.write_text(_SYNC_STEP_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    proc = subprocess.run(
        [sys.executable, *launcher, str(script), str(_SYNC_TINY), model, str(batch), str(out), *overrides],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
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
        _SYNC_TINY, _sync_overrides(tmp_path, tiny_base, tiny_data, "rollout.async=true", "train.max_steps=2")
    )
    result = GRPOTrainer(recipe, tiny_base["path"], tiny_data, progress=False).train()
    rows = [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines()]
    # step 1's next batch is asked for from the version the workers start with (no sync); step 2's after one
    assert [r["weight_sync/bytes"] for r in rows] == [0, float32_bytes]
    assert rows[1]["timing/weight_sync_s"] > 0
