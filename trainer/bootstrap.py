"""The base model a recipe trains, and the embedded default's tiny one (made here: no model hub is reachable).

`resolve_base_model` is the one place a recipe's `model.name_or_path` becomes a model to load: a hub id or
path as given, 'bootstrap' the tiny model below (the pipeline's base-model stage and `grpoflow train` both
call it).

Features, in the order `bootstrap()` builds them:
- a byte-level BPE tokenizer trained locally with `tokenizers` (digits split one per token, the think /
  answer tags as single tokens, a Qwen-style chat template);
- a small Qwen2-architecture causal LM, seeded;
- a supervised warm-up on synthetic worked solutions in the `<think>…</think><answer>…</answer>` format,
  stopped as soon as greedy held-out accuracy enters `target_accuracy`, so GRPO gets a base that is
  neither hopeless nor finished;
- `save_pretrained` for model and tokenizer, so every later stage loads it like a hub model;
- a `manifest.json` holding the config hash: a second call with the same config returns at once, once the
  files are checked against the manifest's sha256 (a corrupt copy is warned about and made again);
- `out` is refused (OutputDirError, before any work) unless it is new, empty or a previous base model.

Raises RuntimeError when the warm-up ends outside the target band (say so rather than hand GRPO a base
that cannot show learning).
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import random
import time
from pathlib import Path

import torch

from data import synthetic
from data.manifest import (
    MANIFEST,
    IntegrityError,
    atomic_dir,
    check_replaceable,
    code_version,
    combined_sha256,
    file_hashes,
    read_manifest,
    sha256_json,
    verify_output,
    write_json_atomic,
)
from data.progress import Progress, quiet_transformers_progress
from data.schema import make_row, resolve_system_prompt
from trainer.heldout import evaluate_greedy
from trainer.multiturn.rollout import in_environment
from trainer.recipe import BootstrapConfig, EnvConfig, ModelConfig
from trainer.rewards import accuracy_reward, format_reward
from trainer.rollout.hf_engine import HFEngine
from trainer.vision import save_tokenizer
from trainer.warmup import TOOL_TOKENS, TOOL_USE, build_tokenizer, sft_batches, worked_solution

KIND = "base-model"
log = logging.getLogger("grpoflow.bootstrap")


def config_hash(cfg: BootstrapConfig, system_prompt: str) -> str:
    settings = dataclasses.asdict(cfg)
    settings.pop("out")  # where it is saved does not change what is made
    if cfg.task not in synthetic.TOOL_KINDS:  # nor does the share of tool calls where no tool is offered
        settings.pop("tool_fraction")
    return sha256_json({**settings, "system_prompt": system_prompt})


def model_config(cfg: BootstrapConfig, vocab_size: int, **token_ids):
    """The tiny base model's transformers config (also what the memory plan sizes before it is made)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        **token_ids,
    )


def build_model(cfg: BootstrapConfig, tokenizer):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(cfg.seed)
    config = model_config(
        cfg,
        len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
    )
    return Qwen2ForCausalLM(config)


def _rows(task: str, n: int, seed: int, pool: str, system_prompt: str) -> list[dict]:
    raw = synthetic.generate(n, seed, task, pool=pool)
    return [
        make_row(
            f"boot-{pool}-{i}",
            r["question"],
            r["answer"],
            "synthetic",
            system_prompt,
            **{k: v for k, v in r.items() if k in ("nums", "target", "tools")},
        )
        for i, r in enumerate(raw)
    ]


def resolve_base_model(
    model: ModelConfig, cfg: BootstrapConfig, system_prompt: str | None = None, progress: bool | None = None
) -> dict:
    """The base model of a recipe: {"path", "heldout_accuracy", "bootstrapped", ...}. A hub id or path is
    taken as given (nothing known of its accuracy); 'bootstrap' is `bootstrap(cfg)`, made on first use and
    cached by its config hash, with `system_prompt` the data's (a preset name or text)."""
    if model.name_or_path != "bootstrap":
        return {"path": model.name_or_path, "heldout_accuracy": None, "bootstrapped": False}
    return {**bootstrap(cfg, system_prompt=system_prompt, progress=progress), "bootstrapped": True}


def bootstrap(
    cfg: BootstrapConfig,
    out: str | Path | None = None,
    system_prompt: str | None = None,
    progress: bool | None = None,
) -> dict:
    """Make (or return the cached) tiny base model; returns a summary with `heldout_accuracy` and `path`.

    `system_prompt` (a preset name or text, as `data.system_prompt`) should match the data GRPO will use.
    """
    out = Path(out or cfg.out).resolve()
    system_prompt = resolve_system_prompt(system_prompt)
    digest = config_hash(cfg, system_prompt)
    if (cached := _cached(out, digest)) is not None:
        return cached
    check_replaceable(out, KIND)  # before minutes of warm-up: an unrelated --out is refused, untouched
    # one maker at a time: a second caller (another `make run`, a second test worker) waits for the first and
    # then finds its model in the cache instead of spending minutes making the same one
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (cached := _cached(out, digest)) is not None:
            return cached
        return _make(cfg, out, system_prompt, digest, progress)


def _cached(out: Path, digest: str) -> dict | None:
    """The summary of the model at `out` when it was made from this config and its files are intact."""
    if (out / MANIFEST).is_file():
        manifest = read_manifest(out)
        if manifest.get("config_hash") == digest:
            try:
                verify_output(out, KIND)
                return {**_summary(manifest, out), "cached": True}
            except IntegrityError as e:
                log.warning("cached base model is corrupt, making it again: %s", e)
    return None


def _make(cfg: BootstrapConfig, out: Path, system_prompt: str, digest: str, progress: bool | None) -> dict:
    started = time.time()
    torch.manual_seed(cfg.seed)
    if (
        cfg.task == "counting"
    ):  # the vision demo: a tiny Qwen2-VL-architecture model on synthetic counting images
        from trainer import tiny_vl as kit
    else:
        kit = TextKit
    train_rows = kit.rows(cfg.task, cfg.sft_rows, cfg.seed, "train", system_prompt)
    heldout_rows = kit.rows(cfg.task, cfg.heldout_rows, cfg.seed, "eval", system_prompt)
    tools = cfg.task in synthetic.TOOL_KINDS
    if tools:  # a seeded share of the worked solutions call the tool, the others answer in the head
        pick = random.Random(f"tool-use:{cfg.seed}")
        train_rows = [{**r, TOOL_USE: pick.random() < cfg.tool_fraction} for r in train_rows]
    model, tokenizer = kit.build(cfg, train_rows, system_prompt)
    engine = HFEngine(model, tokenizer)
    if tools:  # held-out problems are solved as in training: with the calculator at hand
        engine = in_environment(engine, tokenizer, EnvConfig(tools=["calculator"], max_turns=2))
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=0.0)
    warmup = max(1, cfg.max_steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / warmup) * max(0.0, 1 - s / cfg.max_steps)
    )
    batches = kit.sft_batches(model, tokenizer, train_rows, cfg.batch_size, cfg.seed)
    lo, hi = cfg.target_accuracy
    history, accuracy, step = [], 0.0, 0
    evaluate = lambda: evaluate_greedy(  # noqa: E731
        engine,
        tokenizer,
        heldout_rows,
        accuracy_reward,
        format_reward,
        max_tokens=64 if tools else 24,
    )
    with Progress(total=cfg.max_steps, description="warm-up", enabled=progress) as bar:
        for step in range(1, cfg.max_steps + 1):
            model.train()
            ids, mask, labels, extra = next(batches)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels, **extra).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            bar.update(1, loss=f"{loss.item():.3f}", acc=f"{accuracy:.2f}")
            if step % cfg.eval_every == 0:
                result = evaluate()
                accuracy = result["accuracy"]
                history.append({"step": step, "loss": round(loss.item(), 4), **result})
                log.info(
                    "warm-up step %d: loss %.3f, held-out accuracy %.3f, format %.3f (%.0fs)",
                    step,
                    loss.item(),
                    accuracy,
                    result["format_rate"],
                    time.time() - started,
                )
                if lo <= accuracy <= hi or accuracy > hi:
                    break
    final = history[-1] if history and history[-1]["step"] == step else {"step": step, **evaluate()}
    accuracy = final["accuracy"]
    if not lo <= accuracy <= hi:
        raise RuntimeError(
            f"bootstrap: warm-up ended at step {step} with held-out accuracy {accuracy:.3f}, "
            f"outside target_accuracy [{lo}, {hi}]; adjust bootstrap.eval_every, "
            "bootstrap.learning_rate or bootstrap.max_steps"
        )
    with atomic_dir(out, kind=KIND) as tmp:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        quiet_transformers_progress()
        model.save_pretrained(tmp)
        save_tokenizer(tokenizer, tmp)  # with the image processor of a vision model
        files = file_hashes(tmp)
        manifest = {
            "kind": KIND,
            "config_hash": digest,
            "config": dataclasses.asdict(cfg),
            "heldout_accuracy": accuracy,
            "heldout_format_rate": final["format_rate"],
            "heldout_rows": len(heldout_rows),
            "warmup_steps": step,
            "history": history,
            "parameters": sum(p.numel() for p in model.parameters()),
            "seconds": round(time.time() - started, 1),
            "code_version": code_version(),
            "sha256": combined_sha256(files),
            "files": files,
        }
        write_json_atomic(Path(tmp) / MANIFEST, manifest)
    return {**_summary(manifest, out), "cached": False}


class TextKit:
    """The text model's pieces (the vision demo's are in `trainer.tiny_vl`)."""

    @staticmethod
    def rows(task: str, n: int, seed: int, pool: str, system_prompt: str) -> list[dict]:
        return _rows(task, n, seed, pool, system_prompt)

    @staticmethod
    def build(cfg: BootstrapConfig, train_rows: list[dict], system_prompt: str):
        extra = TOOL_TOKENS if cfg.task in synthetic.TOOL_KINDS else []
        tokenizer = build_tokenizer(_corpus(train_rows[:2000], system_prompt), cfg.vocab_size, extra)
        return build_model(cfg, tokenizer), tokenizer

    sft_batches = staticmethod(sft_batches)


def _corpus(rows: list[dict], system_prompt: str) -> list[str]:
    """Tokenizer training text: the problems, their solutions, the prompts and the chat roles."""
    texts = [f"{r['prompt'][-1]['content']} {worked_solution(r)}" for r in rows]
    return texts + [system_prompt, "system", "user", "assistant"] * 200


def _summary(manifest: dict, out: Path) -> dict:
    return {
        "path": str(out),
        "heldout_accuracy": manifest["heldout_accuracy"],
        "heldout_format_rate": manifest.get("heldout_format_rate"),
        "warmup_steps": manifest["warmup_steps"],
        "parameters": manifest["parameters"],
        "seconds": manifest["seconds"],
        "manifest": str(out / MANIFEST),
    }
