"""LoRA: low-rank adapters (PEFT) trained on a frozen base model, and the plain model they make.

What a run with `model.lora` keeps, and where:
- the policy is the base model with PEFT's LoRA layers on `lora.target_modules` (`attach`); only the adapters
  require gradients, so only they reach the optimizer, and its AdamW moments are the adapters' size;
- a checkpoint holds the adapter (`adapter_model.safetensors`, `adapter_config.json`, naming the base model
  by its absolute path or hub id) beside the tokenizer and the training state, not the base weights; resume
  loads the base and then the adapter, trainable (`attach` with the checkpoint);
- rollout engines get the merged weights, W + (alpha / r) B A under the base model's own names
  (`plain_parameters` + `merged`), through the weight sync every engine already takes. Syncing the adapter
  alone would send ~1/10th of the bytes or less, but it needs an engine started with LoRA support (vLLM's
  `enable_lora`: every forward runs the adapter's extra matmuls, and LMDeploy, the transformers workers and
  a server each take adapters differently), and a new adapter id per policy version. The merged weights go
  to every engine through one path and the engine generates at the base model's speed;
- anywhere else an adapter checkpoint is loaded (evaluation, serving, registration, rollout workers started
  from it), `load_model` gives the merged plain model (`merged_from`), and the registry stores that merged
  model: a version must load with MLflow's transformers flavor alone, on a machine that does not have the
  base model at the path it was trained from.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.recipe import LoraConfig

if TYPE_CHECKING:  # torch is imported where it is used: checking a directory (serving, eval) needs none
    import torch

ADAPTER_CONFIG = "adapter_config.json"  # PEFT's: its presence makes a directory an adapter checkpoint
_BASE_LAYER = ".base_layer."  # PEFT's name for the wrapped layer inside a LoRA layer
_ADAPTER_PARAM = ".lora_"  # lora_A, lora_B, lora_embedding_*, lora_magnitude_vector


def is_lora(model) -> bool:
    """Whether `model` is a PEFT model (the trainer's policy under `model.lora`)."""
    peft = sys.modules.get("peft")  # PEFT is imported by whatever made such a model
    return peft is not None and isinstance(model, peft.PeftModel)


def is_adapter_dir(path: str | Path) -> bool:
    """Whether `path` is a local directory holding a PEFT adapter (a LoRA run's checkpoint)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def base_model_of(adapter_dir: str | Path) -> str:
    """The base model an adapter was trained on, as its `adapter_config.json` names it."""
    config = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        base = json.loads(config.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError) as e:
        raise OSError(f"cannot read {config}: {e}") from e
    if not base:
        raise OSError(f"{config} names no base model (base_model_name_or_path)")
    return base


def attach(model: torch.nn.Module, cfg: LoraConfig, base: str, checkpoint: str | Path | None = None):
    """`model` (the base, loaded from `base`) with trainable LoRA adapters: fresh ones as `cfg` describes (B
    is zero, so the policy starts as the base model exactly), or the ones a checkpoint holds."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel, get_peft_model

    if checkpoint is not None:
        return PeftModel.from_pretrained(model, str(checkpoint), is_trainable=True)
    targets = cfg.target_modules
    config = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules="all-linear" if targets == ["all-linear"] else list(targets),
        task_type="CAUSAL_LM",
    )
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as e:  # PEFT's "Target modules {...} not found in the base model"
        raise ValueError(f"model.lora.target_modules {targets}: {e}") from e
    # recorded in adapter_config.json: a checkpoint must find its base from any working directory
    local = Path(base)
    recorded = str(local.resolve()) if local.exists() else base
    peft_model.peft_config["default"].base_model_name_or_path = recorded
    return peft_model


def merged_from(adapter_dir: str | Path, base_model: torch.nn.Module) -> torch.nn.Module:
    """The plain model of an adapter checkpoint: `base_model` with the adapter merged into its weights."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base_model, str(adapter_dir)).merge_and_unload()


def _plain_name(name: str) -> str | None:
    """A base-model tensor's name as a plain model holds it; None for an adapter's own tensors."""
    if _ADAPTER_PARAM in name:
        return None
    return name.replace(_BASE_LAYER, ".")


def _plain(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in items:
        if (plain := _plain_name(name)) is not None:
            yield plain, t


def plain_parameters(model, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """The base model's parameters of a PEFT `model` under a plain model's names and in its order (the
    adapters left out): what `merged` turns into the policy's weights."""
    return _plain(model.get_base_model().named_parameters(remove_duplicate=remove_duplicate))


def plain_state(model) -> Iterator[tuple[str, torch.Tensor]]:
    """`plain_parameters` for every checkpoint tensor (`state_dict`: tied ones under each name)."""
    return _plain(model.get_base_model().state_dict(keep_vars=True).items())


def merged(model, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each (plain name, base tensor) of a PEFT `model` as the policy's weight: the base weight plus its
    adapters' active deltas where the layer has adapters, the base tensor itself elsewhere. Computed one
    tensor at a time and out of place: the base weights are never touched (merging in place and back would
    round them a little at every sync)."""
    import torch
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    for name, t in named:
        module, _, leaf = name.rpartition(".")
        layer = layers.get(module)
        if layer is None or leaf != "weight" or layer.merged:
            yield name, t
            continue
        with torch.no_grad():
            weight = t.detach().float()
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    weight = weight + layer.get_delta_weight(adapter).float()
        yield name, weight.to(t.dtype)


def adapter_parameters(model: torch.nn.Module, cfg: LoraConfig) -> int:
    """The parameters `cfg`'s adapters add to `model` (built on the meta device: no weights needed), as PEFT
    places them: r x (inputs + outputs) per targeted linear layer; "all-linear" is every linear layer but
    the output head, a list names modules by name or name suffix. The memory plan's count of what trains."""
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets = set(cfg.target_modules)
    total = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if targets == {"all-linear"}:
            hit = module is not head
        else:
            hit = any(name == t or name.endswith(f".{t}") for t in targets)
        if hit:
            total += cfg.r * (module.in_features + module.out_features)
    return total


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters an optimizer steps: all of a full fine-tune's, the adapters' alone under LoRA."""
    return [p for p in model.parameters() if p.requires_grad]


__all__ = [
    "ADAPTER_CONFIG",
    "adapter_parameters",
    "attach",
    "base_model_of",
    "is_adapter_dir",
    "is_lora",
    "merged",
    "merged_from",
    "plain_parameters",
    "plain_state",
    "trainable_parameters",
]
