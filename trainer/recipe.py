"""The recipe: every setting of a grpoflow run, typed, with its default and help in one place.

A recipe is YAML (see `configs/`), loaded with `load_recipe(path, overrides)`. Command-line overrides use
dotted keys (`train.learning_rate=1e-4`). GRPO fields keep TRL's names and meanings (`GRPOConfig`) so
that people who know TRL can read a recipe without a dictionary. Nothing else declares these defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from data.errors import short_repr, shown_path
from data.synthetic import MAX_ROWS
from trainer.typed_config import ConfigError, apply_overrides, build, load_yaml, to_dict

# Upper bounds of the numbers that size memory, far past any real run, so that a typo (1e30) is an error
# naming its key rather than an allocation that fails, or never ends, somewhere inside the run.
MAX_TOKENS = 1 << 20  # a sequence length: longer than any model's context (1M-token models included)
MAX_BATCH = 1 << 16  # prompts, completions or examples in one batch
MAX_WIDTH = 1 << 16  # a tiny base model's vocabulary, width or MLP width
MAX_DEPTH = 1 << 10  # a tiny base model's layers or heads


def _f(default, help: str, **meta):
    """A field with help text; mutable defaults go through a factory."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class LoraConfig:
    """Low-rank adapters (PEFT's LoRA) trained on a frozen base model; see `trainer.lora`."""

    r: int = _f(8, "rank of each adapter's two factors", ge=1, le=MAX_WIDTH)
    alpha: float = _f(16.0, "scaling numerator: an adapter adds (alpha / r) * B A to its weight", gt=0)
    dropout: float = _f(0.0, "dropout on an adapter's input while training", ge=0, lt=1)
    target_modules: list[str] = _f(
        ["all-linear"],
        "module names (or name suffixes) that get adapters; ['all-linear']: every linear layer but the "
        "output head",
        min_len=1,
    )


@dataclass
class EnvConfig:
    """A multi-turn environment the policy acts in (`trainer.multiturn`): each trajectory is model turns
    and the environment's observations (tool results), the loss on the model's tokens only."""

    name: str = _f(
        "tools",
        "'tools' (call the tools below until a turn without a call: the final answer), or a user environment "
        "'package.module:Class' / 'path/to/file.py:Class'",
    )
    tools: list[str] = _f(
        ["calculator"], "tools the model may call: built-in names, or 'package.module:name' naming a Tool"
    )
    max_turns: int = _f(
        4, "model turns per trajectory; one still calling tools after this many is cut", ge=1, le=MAX_DEPTH
    )
    tool_timeout_s: float = _f(10.0, "a tool call longer than this answers the model with a timeout", gt=0)
    args: dict = _f({}, "keyword arguments of a user environment's constructor")


@dataclass
class ModelConfig:
    name_or_path: str = _f(
        "bootstrap",
        "HF hub id, local checkpoint path, or 'bootstrap' for the built-in "
        "tiny model (made by `grpoflow bootstrap-model`)",
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = _f("float32", "weights dtype for training")
    modality: Literal["text", "vision"] = _f("text", "'vision' for image+text models (e.g. Qwen2.5-VL)")
    trust_remote_code: bool = _f(False, "passed to from_pretrained")
    attn_implementation: str | None = _f(
        None, "e.g. 'sdpa' or 'flash_attention_2'; None lets transformers choose"
    )
    lora: LoraConfig | None = _f(
        None,
        "train LoRA adapters instead of every weight ({r, alpha, dropout, target_modules}); checkpoints "
        "hold the adapter, engines and the registry get the merged model",
    )


@dataclass
class BootstrapConfig:
    """The embedded default's tiny base model: a small Qwen2 LM + local tokenizer + short SFT warm-up."""

    out: str = _f(".state/models/tiny-base", "where the model is saved (a cache keyed by this config's hash)")
    task: str = _f("addition", "synthetic task kind it is warmed up on")
    vocab_size: int = _f(384, "byte-level BPE vocabulary size, trained locally", ge=1, le=MAX_WIDTH)
    hidden_size: int = _f(128, "model width", ge=1, le=MAX_WIDTH)
    num_layers: int = _f(4, "transformer blocks", ge=1, le=MAX_DEPTH)
    num_heads: int = _f(4, "attention heads", ge=1, le=MAX_DEPTH)
    intermediate_size: int = _f(384, "MLP width", ge=1, le=MAX_WIDTH)
    sft_rows: int = _f(20000, "synthetic worked solutions for the warm-up", ge=1, le=MAX_ROWS)
    tool_fraction: float = _f(
        0.2,
        "a task whose rows offer tools (multiplication): the share of warm-up solutions that call the tool "
        "(the others answer in the head)",
        ge=0,
        le=1,
    )
    heldout_rows: int = _f(256, "held-out problems for the accuracy check", ge=1, le=MAX_ROWS)
    batch_size: int = _f(64, "warm-up batch size", ge=1, le=MAX_BATCH)
    learning_rate: float = _f(3e-3, "warm-up peak learning rate (AdamW, linear decay)", gt=0)
    max_steps: int = _f(
        700, "upper bound on warm-up steps (the learning rate decays linearly to 0 there)", ge=1
    )
    eval_every: int = _f(25, "held-out greedy accuracy is measured every this many steps", ge=1)
    target_accuracy: list[float] = _f(
        [0.3, 0.6],
        "the warm-up stops once greedy held-out accuracy is in this band: a base that GRPO can still improve",
        ge=0,
        le=1,
    )
    seed: int = _f(0, "seed for data, init and training")

    def __post_init__(self):
        if len(self.target_accuracy) != 2:
            raise ValueError(f"target_accuracy must be [lo, hi], got {short_repr(self.target_accuracy)}")
        lo, hi = self.target_accuracy
        if not 0 <= lo < hi <= 1:
            raise ValueError(
                f"target_accuracy must be [lo, hi] with 0 <= lo < hi <= 1, got {self.target_accuracy}"
            )


@dataclass
class DataConfig:
    task: str | None = _f(
        None,
        "task adapter: gsm8k, math, numina, countdown, counting, synthetic; unset, "
        "'synthetic' for a synthetic source and required for any other",
    )
    source: str = _f(
        "synthetic:addition", "local JSONL/Parquet/CSV file or directory, HF hub id, or synthetic[:kind]"
    )
    out: str = _f(".state/data/prepared", "prepared output directory")
    split: str = _f("train", "split to read from a hub dataset or a directory")
    hub_config: str | None = _f(None, "hub dataset configuration name")
    heldout: float = _f(0.1, "held-out set: 0, a fraction in (0, 1) or a whole row count (>= 1)", ge=0)
    seed: int = _f(0, "seed of the train/held-out split and of synthetic generation")
    skip_invalid: bool = _f(False, "drop malformed rows (recorded in the manifest) instead of failing")
    limit: int | None = _f(None, "read at most this many source rows", ge=1)
    synthetic_rows: int = _f(4000, "rows generated for a synthetic source", ge=1, le=MAX_ROWS)
    system_prompt: str = _f(
        "r1",
        "system prompt preset (r1, brief, none) or literal text; the tiny base model "
        "is warmed up with this one too",
    )
    tools: list[str] = _f(
        [],
        "tools every row offers unless it has its own `tools` column: built-in names (calculator) or JSON "
        "files of tool schemas; the chat template shows them, rollout.env runs them",
    )

    def __post_init__(self):
        if self.task is None:  # a guessed adapter would store a gsm8k worked solution as the "answer"
            if self.source != "synthetic" and not self.source.startswith("synthetic:"):
                from data.adapters import ADAPTERS

                raise ValueError(
                    f"task: required for source {shown_path(self.source)} (prep --task, or "
                    f"data.task); one of {', '.join(ADAPTERS)}"
                )
            self.task = "synthetic"
        if self.heldout >= 1 and not float(self.heldout).is_integer():
            raise ValueError(
                f"heldout: {short_repr(self.heldout)} is neither a fraction in (0, 1) nor a whole "
                "number of rows"
            )

    def prepare_kwargs(self) -> dict:
        """Arguments of `data.prepare.prepare` (a held-out value >= 1 is a row count)."""
        heldout = int(self.heldout) if self.heldout >= 1 else self.heldout
        return {
            "task": self.task,
            "source": self.source,
            "out": self.out,
            "seed": self.seed,
            "heldout": heldout,
            "skip_invalid": self.skip_invalid,
            "limit": self.limit,
            "split": self.split,
            "hub_config": self.hub_config,
            "synthetic_rows": self.synthetic_rows,
            "system_prompt": self.system_prompt,
            "tools": self.tools,
        }


@dataclass
class RewardSpec:
    name: str = _f("accuracy", "built-in name, 'package.module:function' or 'path/to/file.py:function'")
    weight: float = _f(1.0, "weight in the summed reward")
    args: dict = _f(
        {},
        "keyword arguments for parameterised rewards (cosine, repetition, soft_overlong); for kind 'model' "
        "the endpoint's settings (mode, model, template, verdict, api_key_env, timeout_s, retries, "
        "concurrency, batch_size, max_tokens)",
    )
    kind: Literal["function", "model"] = _f(
        "function",
        "'function': name is a reward function; 'model': a model behind `endpoint` scores, "
        "name only labels its metrics",
    )
    endpoint: str | None = _f(
        None,
        "kind 'model': the OpenAI-compatible base URL (http://host:8000/v1) of a judge or reward model",
    )

    def __post_init__(self):
        if self.kind == "function":
            if self.endpoint is not None:
                raise ValueError("endpoint: only a reward of kind 'model' has an endpoint")
            return
        if self.endpoint is None:
            raise ValueError("endpoint: required for a reward of kind 'model'")
        from trainer.rewards.model_reward import ModelRewardSettings

        try:
            ModelRewardSettings(endpoint=self.endpoint, **self.args)
        except TypeError as error:  # an unknown key in args
            raise ValueError(f"args: {error}") from None

    def reward_function(self, base_dir=None):
        """The reward function this entry names, with its args."""
        from trainer.rewards import model_reward, resolve_reward

        if self.kind == "model":
            return model_reward(self.endpoint, **self.args)
        return resolve_reward(self.name, self.args, base_dir=base_dir)

    @property
    def label(self) -> str:
        """The name of its metrics (`rewards/<label>/mean`): a plug-in's function name, else the name."""
        return self.name if self.kind == "model" else self.name.rsplit(":", 1)[-1]


ZERO_PRESETS = ("zero1", "zero2", "zero3")  # train.deepspeed shorthands: ZeRO stage 1, 2 or 3
# rollout.gpu_memory_utilization of an engine with its GPUs to itself (vLLM's own default); beside a trainer
# rank the memory plan (trainer/memory_plan.py) gives it the share the trainer leaves
ENGINE_ALONE_UTILIZATION = 0.9


@dataclass
class TrainConfig:
    output_dir: str = _f(
        ".state/runs/train", "checkpoints and metrics.jsonl; rerunning with the same dir resumes"
    )
    max_steps: int = _f(100, "optimizer steps (one generated batch each)", ge=1)
    prompts_per_step: int = _f(4, "distinct prompts per generated batch", ge=1, le=MAX_BATCH)
    num_generations: int = _f(8, "completions per prompt (the GRPO group size)", le=MAX_BATCH)
    num_iterations: int = _f(1, "optimisation passes over each generated batch (mu)", ge=1)
    micro_batch_size: int = _f(
        32,
        "completions per forward/backward; the batch is accumulated over micro-batches",
        ge=1,
        le=MAX_BATCH,
    )
    beta: float = _f(0.0, "KL weight against the reference model; 0 loads no reference model", ge=0)
    epsilon: float = _f(0.2, "lower clipping bound of the ratio (1 - epsilon)", gt=0)
    epsilon_high: float | None = _f(
        None, "upper clipping bound (1 + epsilon_high), also cispo's weight cap; None uses epsilon", gt=0
    )
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo"] = _f(
        "dapo",
        "loss normalisation, as TRL defines them; cispo: MiniMax-M1's objective, the stop-gradient weight "
        "min(ratio, 1 + epsilon_high) times the log-prob (no clipped token loses its gradient), "
        "normalised as dapo",
    )
    importance_sampling_level: Literal["token", "sequence"] = _f(
        "token",
        "the policy ratio per token, or per sequence as GSPO: exp of the mean token log-ratio, clipped per "
        "sequence (the GSPO paper: loss_type grpo, epsilon 3e-4, epsilon_high 4e-4; the other loss types "
        "weigh a sequence by its length)",
    )
    scale_rewards: Literal["group", "batch", "none"] = _f(
        "group", "divide advantages by the group's std, the batch's, or not at all"
    )
    dynamic_sampling: bool = _f(False, "drop groups whose rewards all match (DAPO's dynamic sampling)")
    skip_zero_advantages: bool = _f(
        True,
        "leave completions whose advantage is 0 (e.g. a group whose rewards all match) out of the forward "
        "and backward when beta is 0: they add exactly 0 to the loss and its gradient, so the update is the "
        "same, for less compute; entropy and sampling/* are then means over the completions trained on",
    )
    skip_solved_prompts: int = _f(
        0,
        "a curriculum by the rollout's own accuracy: a prompt whose completions all earned at least "
        "solved_reward passes over its next this many turns in the data order, so steps take more of the "
        "problems not yet solved (trainer.curriculum); 0: off",
        ge=0,
    )
    solved_reward: float | None = _f(
        None,
        "the total reward (weights applied) at which a completion counts as solving its prompt, for "
        "skip_solved_prompts: e.g. the sum of the reward weights when every reward is at most 1",
    )
    temperature: float = _f(1.0, "sampling temperature; the loss uses the same temperature", gt=0)
    top_p: float = _f(1.0, "nucleus sampling", gt=0, le=1)
    max_prompt_length: int = _f(512, "prompts are left-truncated to this many tokens", ge=1, le=MAX_TOKENS)
    max_completion_length: int = _f(256, "completion tokens generated at most", ge=1, le=MAX_TOKENS)
    mask_truncated_completions: bool = _f(
        False, "exclude completions that hit max_completion_length from the loss"
    )
    learning_rate: float = _f(1e-6, "peak learning rate (AdamW)", gt=0)
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = _f("constant", "schedule after warm-up")
    warmup_steps: float = _f(
        0,
        "linear warm-up of the learning rate over this many updates or, below 1, over this fraction of the "
        "run's updates (max_steps x num_iterations) rounded up, as transformers 5 reads warmup_steps: a "
        "recipe cut to fewer steps then warms up over the same share of them",
        ge=0,
    )
    weight_decay: float = _f(0.0, "AdamW weight decay", ge=0)
    adam_beta1: float = _f(0.9, "AdamW's decay of its first moment (the gradient's running mean)", ge=0, lt=1)
    adam_beta2: float = _f(
        0.999,
        "AdamW's decay of its second moment (the running mean of squared gradients): its memory is about "
        "1 / (1 - beta2) updates, over which the step's scale follows the gradient's",
        ge=0,
        lt=1,
    )
    max_grad_norm: float = _f(1.0, "gradient clipping (0 disables)", ge=0)
    save_steps: int = _f(50, "checkpoint every this many steps (and at the end)", ge=1)
    save_total_limit: int = _f(2, "checkpoints kept on disk (0 keeps all)", ge=0)
    eval_heldout: int = _f(256, "held-out problems for the before/after greedy accuracy (0 skips)", ge=0)
    reward_timeout_s: float = _f(10.0, "a reward function call longer than this gives None", gt=0)
    callbacks: list[str] = _f(
        [],
        "extra training callbacks, 'module:factory' or 'file.py:factory'; each factory "
        "returns an object with on_step / on_checkpoint / on_train_end",
    )
    seed: int = _f(0, "seed for sampling and data order")
    deepspeed: str | None = _f(
        None,
        "DeepSpeed ZeRO for the trainer ranks: zero2, zero3 or a path to a ds_config.json "
        "(None: plain DDP); with model.dtype bfloat16 it keeps fp32 master weights",
    )
    gradient_checkpointing: bool = _f(
        False,
        "keep only each decoder layer's input for backward and recompute the rest (transformers' gradient "
        "checkpointing): activations shrink about (13 h + 4 I) / h-fold for one more forward per micro-batch",
    )

    def __post_init__(self):
        # Ranges and finiteness of single values are the fields' metadata (typed_config checks them).
        if self.num_generations < 2:
            raise ValueError("num_generations must be >= 2: GRPO compares completions within a group")
        if self.warmup_steps >= 1 and not float(self.warmup_steps).is_integer():
            raise ValueError(
                "warmup_steps must be a whole number of updates, or a fraction of them below 1, "
                f"got {self.warmup_steps}"
            )
        if self.skip_solved_prompts and self.solved_reward is None:
            raise ValueError(
                "skip_solved_prompts needs solved_reward: the total reward at which a prompt counts as solved"
            )
        if (
            self.deepspeed is not None
            and self.deepspeed not in ZERO_PRESETS
            and not self.deepspeed.endswith(".json")
        ):
            raise ValueError(
                f"deepspeed must be one of {', '.join(ZERO_PRESETS)} or a path to a .json DeepSpeed "
                f"config, got {short_repr(self.deepspeed)}"
            )

    def total_updates(self) -> int:
        """The run's optimizer updates: `num_iterations` on each of the `max_steps` generated batches."""
        return self.max_steps * self.num_iterations

    def warmup_updates(self) -> int:
        """The optimizer updates the learning rate warms up over: `warmup_steps` itself, or its fraction of
        the run's updates rounded up (transformers' rule, so TRL given the same value warms up as long)."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil(self.total_updates() * self.warmup_steps)


@dataclass
class RolloutConfig:
    engine: Literal["transformers", "vllm", "lmdeploy"] = _f("transformers", "generation engine")
    async_: bool = _f(False, "generate batch t+1 while batch t trains (one-step off-policy)", key="async")
    max_staleness: int = _f(1, "how many policy versions a batch may lag behind the trainer", ge=0)
    importance_correction: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = _f(
        "token_truncate",
        "the loss's weight for the engine's (behaviour) log-probs differing from the trainer's: "
        "exp(trainer - engine log-prob) per token, or per sequence (summed over its tokens), truncated at "
        "importance_ratio_cap or 0 above it (TRL's vllm_importance_sampling_mode)",
    )
    importance_ratio_cap: float = _f(
        2.0,
        "the cap of importance_correction: *_truncate clips a weight to it, *_mask drops a token or "
        "sequence above it (TRL's vllm_importance_sampling_clip_max)",
        ge=1,
    )
    importance_correction_on_policy: bool = _f(
        False,
        "correct every batch, also those the current policy version generated (the engine's numerics "
        "against the trainer's, as TRL does for vLLM); false: only batches of an older version (async)",
    )
    colocate: bool = _f(False, "train and generate on the same devices; the engine sleeps during training")
    sleep_level: Literal[1, 2] = _f(1, "vLLM sleep level in colocate mode")
    train_devices: list[int] = _f(
        [], "device ids of the trainer ranks (empty: all not used for rollout)", ge=0
    )
    rollout_devices: list[int] = _f([], "device ids of the rollout engines", ge=0)
    num_engines: int = _f(1, "data-parallel engine instances; prompts are sharded across them", ge=1)
    tensor_parallel_size: int = _f(1, "tensor-parallel size of each engine", ge=1)
    gpu_memory_utilization: float | None = _f(
        None,
        "fraction of each of its GPUs' memory the engine may take (vLLM's meaning; LMDeploy's "
        "cache_max_entry_count). None: from the memory plan (`grpoflow train --dry-run`): "
        f"{ENGINE_ALONE_UTILIZATION} on GPUs of its own, else the share the trainer's parts leave",
        gt=0,
        le=1,
    )
    max_model_len: int | None = _f(
        None,
        "longest sequence the engine holds (None: max_prompt_length + max_completion_length)",
        ge=1,
        le=MAX_TOKENS,
    )
    max_num_batched_tokens: int | None = _f(
        None,
        "vLLM: tokens scheduled per engine step (None: vLLM's default, on "
        "CPU max(max_model_len, 4096); on CPU a set value is raised to "
        "max_model_len: prompts are prefilled whole)",
        ge=1,
        le=MAX_TOKENS,
    )
    enforce_eager: bool = _f(
        False, "vLLM: run eagerly, no CUDA graphs or torch.compile (faster start, slower decode)"
    )
    server_url: str | None = _f(None, "an already-running engine server (vLLM) instead of starting one")
    weight_sync: Literal["auto", "nccl", "reload"] = _f(
        "auto",
        "server mode: nccl (vLLM's NCCL transfer, GPUs) or reload (write safetensors to weights_dir, the "
        "server reloads them; anywhere the server can read weights_dir); auto: nccl with a GPU, else reload",
    )
    weights_dir: str | None = _f(
        None,
        "server mode, weight_sync reload: a directory the server can read (None: a "
        "temporary one on this machine)",
    )
    sync_timeout_s: float = _f(600.0, "timeout of every weight sync and rollout request", gt=0)
    nodes: int = _f(
        1,
        "nodes the trainer ranks span (`grpoflow train --node-rank K --rendezvous HOST:PORT` on each): "
        "node 0 places its GPUs as train_devices / rollout_devices say and holds trainer rank 0; with "
        "rollout workers every other node trains on all its GPUs, else each is placed like node 0",
        ge=1,
        le=4096,
    )
    rendezvous_timeout_s: float = _f(
        600.0,
        "how long the nodes wait for each other at the rendezvous before failing, naming who is missing",
        gt=0,
    )
    env: EnvConfig | None = _f(
        None,
        "multi-turn rollouts in an environment ({name, tools, max_turns, tool_timeout_s, args}); "
        "train.max_completion_length then bounds a whole trajectory after the prompt",
    )

    def __post_init__(self):
        if (
            self.colocate
            and self.rollout_devices
            and self.train_devices
            and set(self.rollout_devices) != set(self.train_devices)
        ):
            raise ValueError(
                "colocate: true shares devices; rollout_devices must equal train_devices (or be empty)"
            )
        if not self.colocate and set(self.rollout_devices) & set(self.train_devices):
            raise ValueError(
                f"devices {sorted(set(self.rollout_devices) & set(self.train_devices))} are in both "
                "train_devices and rollout_devices; set colocate: true to share them"
            )
        n = len(self.rollout_devices)
        if n and n != self.num_engines * self.tensor_parallel_size:
            raise ValueError(
                f"{n} rollout devices cannot host num_engines={self.num_engines} x "
                f"tensor_parallel_size={self.tensor_parallel_size}"
            )


@dataclass
class EvalConfig:
    benchmarks: list[str] = _f(
        ["math_500", "aime24"],
        "EvalScope benchmarks (math_500, aime24, gpqa_diamond); "
        "[]: no EvalScope run, the held-out split is the evaluation "
        "(the vision demo: EvalScope's math sets take no images)",
    )
    local_paths: dict[str, str] = _f({}, "benchmark -> local directory (EvalScope local_path); else the hub")
    limit: int | None = _f(
        None,
        "problems per benchmark subset, as EvalScope applies it (MATH-500 has 5 level "
        "subsets, so limit 2 scores 10 problems); None: all",
        ge=1,
    )
    repeats: int = _f(1, "samples per problem (pass@k)", ge=1, le=MAX_BATCH)
    max_tokens: int = _f(1024, "generation budget per answer", ge=1, le=MAX_TOKENS)
    temperature: float = _f(0.0, "0 is greedy", ge=0)
    request_timeout_s: float = _f(
        600.0,
        "an endpoint's longest wait for one answer (and its pre-flight check's "
        "connect timeout); a request that takes longer fails",
        gt=0,
    )
    out: str = _f(".state/eval", "evaluation outputs")


@dataclass
class RegistryConfig:
    model_name: str = _f("grpoflow-tiny", "registered model name in MLflow")
    experiment: str = _f("grpoflow", "MLflow experiment")


@dataclass
class Recipe:
    name: str = _f("unnamed", "recipe name")
    description: str = _f("", "what this recipe is for")
    model: ModelConfig = field(
        default_factory=ModelConfig,
        metadata={"help": "the base model trained: where it comes from and how it is loaded"},
    )
    bootstrap: BootstrapConfig = field(
        default_factory=BootstrapConfig,
        metadata={
            "help": "the built-in tiny base model (model.name_or_path: bootstrap), made and cached locally"
        },
    )
    data: DataConfig = field(
        default_factory=DataConfig,
        metadata={
            "help": "the dataset: its source, task adapter, held-out split and system prompt (grpoflow prep)"
        },
    )
    train: TrainConfig = field(
        default_factory=TrainConfig,
        metadata={"help": "GRPO training: batch, loss, optimiser, checkpoints (TRL's GRPOConfig names)"},
    )
    rollout: RolloutConfig = field(
        default_factory=RolloutConfig,
        metadata={"help": "generation of the completions: engine, devices, async mode, weight sync"},
    )
    rewards: list[RewardSpec] = field(
        default_factory=lambda: [RewardSpec("format", 0.5), RewardSpec("accuracy", 1.0)],
        metadata={
            "help": "the reward functions, summed with their weights; each entry is a name, a weight "
            "and args (kind 'model' adds an endpoint); at least one"
        },
    )
    eval: EvalConfig = field(
        default_factory=EvalConfig,
        metadata={"help": "the EvalScope benchmarks run on a trained model (grpoflow eval, grpoflow run)"},
    )
    registry: RegistryConfig = field(
        default_factory=RegistryConfig, metadata={"help": "where a trained model is registered in MLflow"}
    )

    def __post_init__(self):
        if not self.rewards:
            raise ValueError("rewards: at least one reward function is needed")
        if self.rollout.colocate and self.rollout.async_:
            raise ValueError(
                "rollout.async with rollout.colocate is not supported: colocated engines sleep "
                "while training, so there is nothing to overlap; set rollout.async=false to colocate"
            )
        if self.rollout.env is not None and self.model.modality == "vision":
            raise ValueError(
                "rollout.env with model.modality vision is not supported: multi-turn trajectories are text "
                "only (an observation cannot carry images)"
            )

    def to_dict(self) -> dict:
        return to_dict(self)


def load_recipe(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Load a recipe from YAML (or the defaults when `path` is None) and apply `key=value` overrides."""
    data = load_yaml(path) if path else {}
    source = str(path) if path else "<defaults>"
    try:
        data = apply_overrides(data, overrides)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    if overrides:
        source += " + overrides"
    return build(Recipe, data, source)


__all__ = [
    "BootstrapConfig",
    "ConfigError",
    "DataConfig",
    "ENGINE_ALONE_UTILIZATION",
    "EnvConfig",
    "EvalConfig",
    "LoraConfig",
    "ModelConfig",
    "Recipe",
    "RegistryConfig",
    "RewardSpec",
    "RolloutConfig",
    "TrainConfig",
    "load_recipe",
]
