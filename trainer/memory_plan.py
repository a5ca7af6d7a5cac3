"""The memory plan: what each GPU of a run holds, in GiB, from the recipe and the model's config alone (no
weights loaded, no GPU touched), so that a recipe that cannot fit is refused before anything loads and a
colocated engine gets the share the trainer leaves.

Per trainer rank, for P parameters computing in a dtype of `a` bytes over N trainer ranks:
- weights: P*a (ZeRO-3: P*a/N, plus up to stage3_max_live_parameters gathered at once);
- gradients: without DeepSpeed the fp32 gradients of the master weights, 4P (the compute-dtype ones are
  freed as they are widened; float32: P*a), plus DDP's reduce buckets (another P*a) over several ranks;
  ZeRO-1 keeps whole compute-dtype gradients, ZeRO-2/3 their 1/N partition, both the fp32 partition the
  optimizer steps (4P/N) and DeepSpeed's reduce buckets;
- master_weights: fp32 copies whenever the compute dtype is bf16/fp16 (DeepSpeed's ZeRO optimizer and
  `trainer/strategy/precision.py` both keep them), 4P, ZeRO-1/2/3: 4P/N;
- optimizer_states: AdamW's two fp32 moments, 8P, ZeRO-1/2/3: 8P/N (offloaded to the CPU: 0);
- under `model.lora` the gradients and moments are those of the adapters' T parameters
  (`trainer.lora.adapter_parameters`) in place of P, in fp32 (PEFT keeps a bf16 model's adapters in fp32,
  so there are no master copies): the base model's weights only run forward;
- reference: the whole reference model, P*a, when train.beta > 0;
- activations: an estimate of what autograd keeps for backward at one micro-batch (`activation_bytes`);
- kv_cache: the engine's memory on the GPU: vLLM / LMDeploy take rollout.gpu_memory_utilization of it (their
  weight copy, activations and KV cache all live in that share); the transformers engine, the KV cache of its
  generation batch (and on a GPU of its own, its model copy under weights).
A GPU that holds a trainer rank and an engine that frees its memory while the trainer trains (a colocated
engine sleeps; transformers' cache is freed after generating) peaks at the larger of the two phases: training
(every part but kv_cache) and generation (every part but activations). Elsewhere the parts add up.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

from trainer.heldout import HELDOUT_BATCH_SIZE
from trainer.lora import adapter_parameters
from trainer.placement import nodes_plan, plan, planned_node, trainer_ranks
from trainer.recipe import ENGINE_ALONE_UTILIZATION, Recipe, RolloutConfig
from trainer.typed_config import ConfigError

log = logging.getLogger("grpoflow.train")

GIB = 1 << 30
RESERVED_GIB = (
    2.0  # per GPU beyond the parts: the CUDA context, NCCL's buffers, the allocator's fragmentation
)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PARTS = (
    "weights",
    "gradients",
    "master_weights",
    "optimizer_states",
    "reference",
    "activations",
    "kv_cache",
)
# DeepSpeed's defaults for what a ds_config.json leaves out (elements)
DS_REDUCE_BUCKET = 5e8
DS_MAX_LIVE_PARAMETERS = 1e9

# The shipped recipes' models, for when their config.json cannot be read (no hub, not in the hub cache): the
# public config.json values that size them.
_QWEN25_3B = {
    "model_type": "qwen2",
    "hidden_size": 2048,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "intermediate_size": 11008,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
KNOWN_SHAPES = {
    "Qwen/Qwen2.5-7B-Instruct": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "Qwen/Qwen2.5-32B-Instruct": {
        "model_type": "qwen2",
        "hidden_size": 5120,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "intermediate_size": 27648,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "Qwen/Qwen2.5-3B-Instruct": _QWEN25_3B,
    "Qwen/Qwen2.5-VL-3B-Instruct": {
        "model_type": "qwen2_5_vl",
        "text_config": {**_QWEN25_3B, "model_type": "qwen2_5_vl_text"},
        "vision_config": {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "out_hidden_size": 2048,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
        },
        "tie_word_embeddings": True,
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
    },
}


class MemoryPlanError(ConfigError):
    """The recipe does not fit its GPUs; the message names the fields to change."""


@dataclass(frozen=True)
class ModelShape:
    """What sizes a model's memory, read from its config."""

    params: int
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    kv_width: int  # key/value heads x head dim: one layer's K (or V) per token
    dtype: str  # the checkpoint's own dtype (what model.dtype "auto" loads)
    source: str  # where the shape was read
    trainable: int | None = None  # the parameters the optimizer steps: the LoRA adapters' (None: all)

    @property
    def stepped(self) -> int:
        return self.params if self.trainable is None else self.trainable


# ---- the model's shape, from its config --------------------------------------------------------------------


def model_shape(recipe: Recipe) -> ModelShape:
    """The shape of `model.name_or_path` from its config.json, never its weights: the bootstrap model's own
    config (made or not), a local directory's, a hub id's from the hub cache, else the known shapes of the
    shipped recipes' models, else the hub (unless HF_HUB_OFFLINE). MemoryPlanError when none can be read."""
    name, model = recipe.model.name_or_path, recipe.model
    if name == "bootstrap":
        made = Path(recipe.bootstrap.out) / "config.json"
        if made.is_file():
            return _shape(_auto_config(str(made.parent), model, local=True), model, f"{made}")
        from trainer.bootstrap import model_config

        # the tokenizer adds a few special tokens to the vocabulary: a rounding error at this size
        return _shape(
            model_config(recipe.bootstrap, recipe.bootstrap.vocab_size), model, "bootstrap settings"
        )
    if Path(name).is_dir():
        return _shape(_auto_config(name, model, local=True), model, f"{name}/config.json")
    try:
        return _shape(_auto_config(name, model, local=True), model, f"the hub cache's {name}")
    except (OSError, ValueError):
        pass
    if name in KNOWN_SHAPES:
        from transformers import AutoConfig

        fields = dict(KNOWN_SHAPES[name])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        return _shape(config, model, f"the known shapes of {name} (its config.json is not readable here)")
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        raise MemoryPlanError(
            f"model.name_or_path: cannot size {name!r}: its config.json is neither a local directory's nor "
            "in the hub cache, and HF_HUB_OFFLINE is set"
        )
    try:
        return _shape(_auto_config(name, model, local=False), model, f"the hub's {name}")
    except (OSError, ValueError) as e:
        raise MemoryPlanError(
            f"model.name_or_path: cannot read {name!r}'s config.json to size it: {e}"
        ) from e


def _auto_config(name: str, model, local: bool):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(name, trust_remote_code=model.trust_remote_code, local_files_only=local)


def _shape(config, model, source: str) -> ModelShape:
    """Count the parameters of the model `config` describes, built on the meta device (no memory, no
    weights), and read the text model's dimensions."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if model.modality == "vision" else AutoModelForCausalLM
    with torch.device("meta"):
        built = auto.from_config(config, trust_remote_code=model.trust_remote_code)
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    dtype = str(dtype).removeprefix("torch.")
    return ModelShape(
        trainable=None if model.lora is None else adapter_parameters(built, model.lora),
        params=sum(p.numel() for p in built.parameters()),
        hidden=text.hidden_size,
        layers=text.num_hidden_layers,
        intermediate=text.intermediate_size,
        vocab=text.vocab_size,
        kv_width=(getattr(text, "num_key_value_heads", None) or heads) * head_dim,
        dtype=dtype if dtype in DTYPE_BYTES else "float32",
        source=source,
    )


# ---- the parts ---------------------------------------------------------------------------------------------


def activation_bytes(
    shape: ModelShape,
    dtype_bytes: int,
    micro_batch: int,
    seq: int,
    completion: int,
    checkpointed: bool = False,
) -> int:
    """An estimate of what one micro-batch's forward keeps for its backward.

    Per token and decoder layer, counted on transformers' Qwen2/Llama layers with SDPA: the two RMSNorms
    (their input widened to fp32 and the normalised output), the attention's input, q, k, v (at full width:
    grouped heads are repeated), its output and o_proj's input, the MLP's input, gate, up, SiLU(gate) and
    their product: (13 h + 4 I) values of the compute dtype (measured with autograd's saved-tensor hooks on a
    small Qwen2 in bf16: within 3 %). Per completion position: the logits in the compute dtype and their
    gradient, and the fp32 log-softmax input (`trainer.loss.sequence_logps`). With gradient checkpointing
    (`checkpointed`) each layer keeps its input alone (h values per token), and one layer at a time is
    recomputed whole for its backward."""
    layer = micro_batch * seq * (13 * shape.hidden + 4 * shape.intermediate) * dtype_bytes
    if checkpointed:
        layers = micro_batch * seq * shape.layers * shape.hidden * dtype_bytes + layer
    else:
        layers = layer * shape.layers
    logits = micro_batch * completion * shape.vocab * (2 * dtype_bytes + 4)
    return layers + logits


@dataclass(frozen=True)
class _Zero:
    stage: int = 0  # 0: no DeepSpeed
    offload_optimizer: bool = False
    offload_param: bool = False
    bucket_elements: float = 0.0  # DeepSpeed's reduce buffers (elements)
    live_parameters: float = 0.0  # ZeRO-3: parameters gathered at once, at most


def _zero(recipe: Recipe) -> _Zero:
    if not recipe.train.deepspeed:
        return _Zero()
    from trainer.deepspeed_setup import recipe_config

    config = recipe_config(
        recipe.train.deepspeed,
        micro_batch_size=recipe.train.micro_batch_size,
        max_grad_norm=recipe.train.max_grad_norm,
        bf16=recipe.model.dtype == "bfloat16",
    )
    zero = config.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))

    def number(key: str, default: float) -> float:
        value = zero.get(key, default)
        return float(value) if isinstance(value, (int, float)) else default

    def offloaded(key: str) -> bool:
        return (zero.get(key) or {}).get("device", "none") in ("cpu", "nvme")

    bucket = number("reduce_bucket_size", DS_REDUCE_BUCKET)
    if stage in (1, 2):  # contiguous reduce buffers, a second one to overlap the reduction with backward
        buffers = (
            (2 if zero.get("overlap_comm", False) else 1) if zero.get("contiguous_gradients", True) else 0
        )
        bucket *= buffers
    return _Zero(
        stage,
        offloaded("offload_optimizer"),
        offloaded("offload_param"),
        bucket if stage else 0.0,
        number("stage3_max_live_parameters", DS_MAX_LIVE_PARAMETERS) if stage == 3 else 0.0,
    )


def compute_dtype(recipe: Recipe, shape: ModelShape) -> str:
    """The dtype the trainer computes in: model.dtype, "auto" being the checkpoint's own."""
    return shape.dtype if recipe.model.dtype == "auto" else recipe.model.dtype


def trainer_parts(recipe: Recipe, shape: ModelShape, ranks: int) -> dict[str, float]:
    """Bytes each part takes on one of `ranks` trainer ranks' GPU (kv_cache 0: the engine's is added per
    device)."""
    cfg, P, T = recipe.train, shape.params, shape.stepped  # T: what trains (a LoRA run: its adapters)
    a = DTYPE_BYTES[compute_dtype(recipe, shape)]
    lora = shape.trainable is not None
    masters = a < 4 and not lora  # PEFT keeps a bf16 model's adapters in fp32: their own master weights
    g = 4 if lora else a  # bytes of a trained parameter (and its gradient)
    z = _zero(recipe)
    shard = ranks if z.stage >= 1 else 1
    weights = P * a / ranks + min(P, z.live_parameters) * a if z.stage == 3 else P * a
    if z.stage == 0:
        gradients = (4 * T if masters else T * g) + (T * g if ranks > 1 else 0)  # DDP's buckets
    else:
        low = P * a if z.stage == 1 else P * a / ranks
        gradients = (
            low + (4 * P / ranks if masters and not z.offload_optimizer else 0) + z.bucket_elements * a
        )
    if z.offload_param:
        weights = min(P, z.live_parameters or P) * a
    seq = cfg.max_prompt_length + cfg.max_completion_length
    return {
        "weights": weights,
        "gradients": gradients,
        "master_weights": 0 if not masters or z.offload_optimizer else 4 * T / shard,
        "optimizer_states": 0 if z.offload_optimizer else 8 * T / shard,
        "reference": P * a if cfg.beta > 0 else 0,
        "activations": activation_bytes(
            shape, a, cfg.micro_batch_size, seq, cfg.max_completion_length, cfg.gradient_checkpointing
        ),
        "kv_cache": 0,
    }


# ---- the plan ----------------------------------------------------------------------------------------------


@dataclass
class _Device:
    index: int
    processes: list[str]
    trainer: bool = False
    engine: str | None = None  # transformers | vllm | lmdeploy
    engine_devices: int = 1  # GPUs the engine on it spans (tensor parallel)
    generates_for: int = 1  # trainer ranks or engines the batch is shared over


def _devices(recipe: Recipe, placement, n_trainers: int) -> list[_Device]:
    """Each GPU of the node's plan with the trainer rank and the engine on it (`n_trainers`: the run's)."""
    rollout, devices = recipe.rollout, {}

    def at(d: int) -> _Device:
        return devices.setdefault(d, _Device(d, []))

    for p in placement.trainers:
        d = at(p.devices[0])
        d.trainer = True
        d.processes.append(p.name)
        if p.engine_device is None or placement.mode not in ("colocated", "in-process"):
            continue  # server: the engine is elsewhere; rollout workers: this rank's engine is evaluation's
        if p.engine_device == p.device:
            d.engine, d.engine_devices, d.generates_for = (
                rollout.engine,
                rollout.tensor_parallel_size,
                n_trainers,
            )
        elif p.name == "trainer rank 0":  # a lone trainer's engine on GPUs of its own
            for e in placement.rollout_devices[0]:
                g = at(e)
                g.engine, g.engine_devices = rollout.engine, len(placement.rollout_devices[0])
                g.processes.append(f"{p.name}'s {rollout.engine} engine")
    for w in placement.workers:
        for e in w.devices:
            g = at(e)
            g.engine, g.engine_devices, g.generates_for = (
                rollout.engine,
                len(w.devices),
                len(placement.workers),
            )
            g.processes.append(w.name)
    return [devices[k] for k in sorted(devices)]


def _frees_while_training(recipe: Recipe, device: _Device) -> bool:
    """True when the engine on a trainer's GPU gives its memory back while the trainer trains."""
    return device.engine == "transformers" or recipe.rollout.colocate


def _engine_minimum(recipe: Recipe, shape: ModelShape, device: _Device) -> float:
    """Bytes a vLLM / LMDeploy share must hold on each of its GPUs: its weight copy and the KV cache of one
    sequence of max_model_len tokens (vLLM refuses to start with less)."""
    e = DTYPE_BYTES[compute_dtype(recipe, shape)]
    max_len = (
        recipe.rollout.max_model_len or recipe.train.max_prompt_length + recipe.train.max_completion_length
    )
    return (shape.params * e + 2 * shape.layers * shape.kv_width * e * max_len) / device.engine_devices


def _transformers_kv(recipe: Recipe, shape: ModelShape, device: _Device) -> float:
    """The KV cache of the transformers engine's generation batch (its share of the step's completions)."""
    cfg = recipe.train
    seqs = math.ceil(cfg.prompts_per_step * cfg.num_generations / device.generates_for)
    a = DTYPE_BYTES[compute_dtype(recipe, shape)]
    return seqs * (cfg.max_prompt_length + cfg.max_completion_length) * 2 * shape.layers * shape.kv_width * a


def _utilization(resident: float, gpu: float) -> float:
    """The share of a GPU of `gpu` bytes left beside `resident` bytes (and the reserve), in hundredths."""
    left = (gpu - RESERVED_GIB * GIB - resident) / gpu
    return max(0.0, min(ENGINE_ALONE_UTILIZATION, math.floor(left * 100) / 100))


def estimate(
    recipe: Recipe,
    gpus: int | None = None,
    gpu_memory_gib: float = 80.0,
    *,
    shape: ModelShape | None = None,
) -> dict:
    """The memory plan of `recipe` on a node of `gpus` GPUs (as `grpoflow train --dry-run` plans it: else the
    GPUs this machine sees, else the fewest the recipe's device ids need) of `gpu_memory_gib` GiB each:
    {"gpu_memory_gib", "fits", "devices": [{"device", "role", "parts": {part: GiB}, "total_gib", "fits"}],
    "notes"}. `shape`: the model's, when already known (default: read from its config)."""
    node, _ = planned_node(recipe.rollout, gpus)
    placements = nodes_plan(recipe.rollout, node)[:2]  # node 0, and one for the nodes after it (all alike)
    placement = placements[0]
    notes = [
        f"GiB = 2^30 bytes; a GPU fits when its total and {RESERVED_GIB:g} GiB for the CUDA context, NCCL "
        "and fragmentation fit in gpu_memory_gib",
    ]
    if not placement.gpus:
        notes.append("no GPU in this plan (CPU): there is nothing to size; CPU runs are not checked")
        return {"gpu_memory_gib": gpu_memory_gib, "fits": True, "dtype": None, "devices": [], "notes": notes}
    shape = shape or model_shape(recipe)
    gpu = gpu_memory_gib * GIB
    ranks = trainer_ranks(recipe.rollout, node)
    per_trainer = trainer_parts(recipe, shape, ranks)
    dtype = compute_dtype(recipe, shape)
    a = DTYPE_BYTES[dtype]
    out, fits = [], True
    devices = [(p.node, d) for p in placements for d in _devices(recipe, p, ranks)]
    for on_node, device in devices:
        parts = dict(per_trainer) if device.trainer else dict.fromkeys(PARTS, 0)
        problem = None
        if device.engine == "transformers":
            parts["kv_cache"] = _transformers_kv(recipe, shape, device)
            if not device.trainer:  # a rollout worker's own copy of the policy
                parts["weights"] = shape.params * a
        elif device.engine is not None:
            share = engine_utilization(recipe, gpus, gpu_memory_gib, shape=shape) * gpu
            parts["kv_cache"] = share
            minimum = _engine_minimum(recipe, shape, device)
            if share < minimum:
                problem = (
                    f"its {device.engine} engine's share ({share / GIB:.1f} GiB) cannot hold its weights and "
                    f"one max_model_len sequence ({minimum / GIB:.1f} GiB)"
                )
        summed = sum(parts.values())
        if device.trainer and device.engine and _frees_while_training(recipe, device):
            total = max(summed - parts["kv_cache"], summed - parts["activations"])
        else:
            total = summed
        reserve = RESERVED_GIB * GIB if device.trainer or device.engine == "transformers" else 0
        ok = problem is None and total + reserve <= gpu
        fits = fits and ok
        role = "colocated" if device.trainer and device.engine else "trainer" if device.trainer else "rollout"
        out.append(
            {
                **({"node": on_node} if recipe.rollout.nodes > 1 else {}),
                "device": f"cuda:{device.index}",
                "role": role,
                "processes": device.processes,
                "parts": {k: round(v / GIB, 3) for k, v in parts.items()},
                "total_gib": round(total / GIB, 3),
                "fits": ok,
                **({"problem": problem} if problem else {}),
            }
        )
    notes += _notes(recipe, shape, placement, ranks)
    if recipe.rollout.nodes > 2:
        notes.append(f"nodes 2-{recipe.rollout.nodes - 1} are planned as node 1 is")
    return {"gpu_memory_gib": gpu_memory_gib, "fits": fits, "dtype": dtype, "devices": out, "notes": notes}


def _notes(recipe: Recipe, shape: ModelShape, placement, ranks: int) -> list[str]:
    cfg, z = recipe.train, _zero(recipe)
    dtype = compute_dtype(recipe, shape)
    seq = cfg.max_prompt_length + cfg.max_completion_length
    checkpointing = "gradient checkpointing" if cfg.gradient_checkpointing else "no gradient checkpointing"
    notes = [
        f"model: {shape.params / 1e9:.3f}B parameters, from {shape.source}; trains in {dtype} on {ranks} "
        f"trainer rank(s), "
        + (f"DeepSpeed ZeRO-{z.stage}" if z.stage else "DDP" if ranks > 1 else "one process"),
        f"activations: an estimate (what autograd keeps for backward, {checkpointing}) at "
        f"train.micro_batch_size {cfg.micro_batch_size} x {seq} tokens, and the completion logits",
        "kv_cache: a vLLM / LMDeploy engine's whole share (rollout.gpu_memory_utilization x the GPU: its "
        "weight copy, activations and KV cache); the transformers engine's generation KV cache",
    ]
    if recipe.rollout.colocate or placement.mode == "in-process":
        notes.append(
            "a GPU with a trainer rank and an engine that frees its memory while training (colocated: it "
            "sleeps; the transformers engine) peaks at the larger of training (all but kv_cache) and "
            "generation (all but activations)"
        )
    if recipe.rollout.gpu_memory_utilization is None and recipe.rollout.engine != "transformers":
        notes.append(
            f"rollout.gpu_memory_utilization unset: {ENGINE_ALONE_UTILIZATION} on GPUs of the engine's own, "
            "else the share the trainer leaves (engine_utilization)"
        )
    if placement.mode == "workers":
        notes.append("not counted: the held-out evaluation's generation on trainer rank 0 (before and after)")
    if recipe.model.modality == "vision":
        notes.append("vision: the images' tokens and the vision tower's activations are not counted")
    return notes


def engine_utilization(
    recipe: Recipe, gpus: int | None = None, gpu_memory_gib: float = 80.0, *, shape: ModelShape | None = None
) -> float:
    """rollout.gpu_memory_utilization, or when unset the memory plan's: ENGINE_ALONE_UTILIZATION for an engine
    with its GPUs to itself, else (beside a trainer rank) the share of the GPU the trainer's parts leave: all
    of them when the engine stays awake while the trainer trains, all but the activations when it sleeps."""
    rollout = recipe.rollout
    if rollout.gpu_memory_utilization is not None:
        return rollout.gpu_memory_utilization
    placement = plan(rollout, planned_node(rollout, gpus)[0])
    beside = placement.mode in ("colocated", "in-process") and any(
        p.engine_device == p.device for p in placement.trainers
    )
    if not placement.gpus or not beside or rollout.engine == "transformers":
        return ENGINE_ALONE_UTILIZATION
    shape = shape or model_shape(recipe)
    parts = trainer_parts(recipe, shape, trainer_ranks(rollout, placement.gpus))
    resident = sum(parts.values()) - (parts["activations"] if rollout.colocate else 0)
    return _utilization(resident, gpu_memory_gib * GIB)


# ---- where a run uses it -----------------------------------------------------------------------------------


def device_label(device: dict) -> str:
    """A device of the plan as people read it: `cuda:3`, or `node 1 cuda:3` in a multi-node plan."""
    return device["device"] if "node" not in device else f"node {device['node']} {device['device']}"


def refuse_unless_fits(recipe: Recipe, memory: dict) -> None:
    """MemoryPlanError naming the GPUs over their size and the recipe fields that would shrink them, unless
    the plan `memory` (`estimate(recipe)`) fits."""
    if memory["fits"]:
        return
    over = [d for d in memory["devices"] if not d["fits"]]
    size = memory["gpu_memory_gib"]
    alike: dict[str, list[str]] = {}  # GPUs that hold the same are named on one line
    for d in over:
        what = (
            f"({d['role']}) needs {d['total_gib']:.1f} GiB and {RESERVED_GIB:g} reserved of {size:g}: "
            + ", ".join(f"{k} {v:.1f}" for k, v in d["parts"].items() if v)
            + (f"; {d['problem']}" if "problem" in d else "")
        )
        alike.setdefault(what, []).append(device_label(d))
    lines = [f"{', '.join(devices)} {what}" for what, devices in alike.items()]
    raise MemoryPlanError(
        f"the memory plan does not fit GPUs of {size:g} GiB:\n  "
        + "\n  ".join(lines)
        + "\nchange "
        + "; or ".join(_remedies(recipe, memory["dtype"], over))
    )


def _remedies(recipe: Recipe, dtype: str, over: list[dict]) -> list[str]:
    """The recipe fields that would shrink the GPUs `over`."""
    cfg, stage = recipe.train, _zero(recipe).stage
    parts = {k: max(d["parts"][k] for d in over) for k in PARTS}
    found = []
    if dtype == "float32" and parts["weights"]:
        found.append("model.dtype (bfloat16 halves the weights, the reference and the activations)")
    if stage < 3 and parts["optimizer_states"] and recipe.model.modality != "vision":  # ZeRO refuses images
        what = (
            "zero2 shards the gradients, fp32 master weights and Adam states" if stage < 2 else "zero3 also "
        )
        what += "" if stage < 2 else "shards the weights"
        found.append(f"train.deepspeed ({what} over the trainer ranks)")
    if cfg.micro_batch_size > 1 and parts["activations"]:
        found.append(
            f"train.micro_batch_size (activations {parts['activations']:.1f} GiB at {cfg.micro_batch_size})"
        )
    if parts["reference"]:
        found.append(f"train.beta (0 loads no reference model: {parts['reference']:.1f} GiB)")
    if parts["kv_cache"] and recipe.rollout.engine != "transformers":
        found.append(f"rollout.gpu_memory_utilization (the engine's share: {parts['kv_cache']:.1f} GiB)")
    found.append("train.max_prompt_length / train.max_completion_length (the activations' tokens)")
    return found


def check_gpu_memory(recipe: Recipe) -> dict | None:
    """Before a GPU run loads anything: the memory plan for this node's GPUs at their real size, refused
    (MemoryPlanError) when it does not fit; None on a machine without GPUs (a CPU run is not checked)."""
    import torch

    if not torch.cuda.is_available():
        log.info("no GPU: the memory plan is not checked (a CPU run)")
        return None
    # the device properties come from the driver: no CUDA context is made, so this runs before set_device
    size = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    memory = estimate(recipe, gpu_memory_gib=round(size / GIB, 2))
    refuse_unless_fits(recipe, memory)
    return memory


def heldout_rows(recipe: Recipe, memory: dict | None, shape: ModelShape | None = None) -> int:
    """Held-out rows a trainer rank generates at once: as many as the KV cache of one greedy row (prompt and
    completion at their maximum lengths) fits in what the plan leaves on a trainer GPU once
    training has begun (weights, gradients, masters, Adam states and reference stay; activations do not),
    at most HELDOUT_BATCH_SIZE and at least 1. `memory`: the plan (`estimate`); None (a CPU run) gives
    HELDOUT_BATCH_SIZE."""
    trainers = [d for d in (memory or {}).get("devices", []) if d["role"] in ("trainer", "colocated")]
    if not trainers:
        return HELDOUT_BATCH_SIZE
    shape = shape or model_shape(recipe)
    cfg = recipe.train
    a = DTYPE_BYTES[compute_dtype(recipe, shape)]
    per_row = (cfg.max_prompt_length + cfg.max_completion_length) * 2 * shape.layers * shape.kv_width * a
    parts = trainer_parts(recipe, shape, len(trainers))  # unrounded: the plan shows GiB to 3 decimals
    resident = sum(v for k, v in parts.items() if k not in ("activations", "kv_cache"))
    free = (memory["gpu_memory_gib"] - RESERVED_GIB) * GIB - resident
    return max(1, min(HELDOUT_BATCH_SIZE, int(free // per_row)))


def engine_rollout(recipe: Recipe) -> RolloutConfig:
    """The recipe's rollout settings with the engine's share resolved from the memory plan when unset, for
    this node's GPUs at their real size (on CPU, where vLLM sizes its cache by VLLM_CPU_KVCACHE_SPACE
    instead, the share of an engine alone)."""
    if recipe.rollout.gpu_memory_utilization is not None:
        return recipe.rollout
    import torch

    if torch.cuda.is_available():
        size = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB
        share = engine_utilization(recipe, gpu_memory_gib=size)
    else:
        share = ENGINE_ALONE_UTILIZATION
    return replace(recipe.rollout, gpu_memory_utilization=share)


__all__ = [
    "GIB",
    "KNOWN_SHAPES",
    "PARTS",
    "RESERVED_GIB",
    "MemoryPlanError",
    "ModelShape",
    "activation_bytes",
    "check_gpu_memory",
    "device_label",
    "engine_rollout",
    "engine_utilization",
    "estimate",
    "heldout_rows",
    "model_shape",
    "refuse_unless_fits",
    "trainer_parts",
]
