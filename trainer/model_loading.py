"""Loading a model by hub id or local path (a recipe's 'bootstrap' is resolved to a path by
`trainer.bootstrap.resolve_base_model` first).

`load_model` is the one loader: the trainer's policy and reference, the transformers rollout engine, the
asynchronous rollout workers, held-out evaluation and the model server all call it, so dtype, remote code,
the pad token (the EOS token when a tokenizer has none) and left padding are decided in one place.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
from pathlib import Path

import torch

from data.manifest import MANIFEST, verify_output
from data.progress import quiet_transformers_progress
from trainer.lora import base_model_of, is_adapter_dir, merged_from
from trainer.recipe import ModelConfig

log = logging.getLogger("grpoflow.model_loading")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def load_model(
    name_or_path: str,
    cfg: ModelConfig | None = None,
    device: str | torch.device = "cpu",
    *,
    verify: bool = True,
):
    """Model and tokenizer through transformers' Auto classes, exactly as for any hub model; `cfg` gives the
    dtype, `trust_remote_code` and attention implementation (`ModelConfig()`'s defaults when None).

    A grpoflow checkpoint or base model (a directory with our manifest) is first checked against the sha256
    its manifest recorded (`verify=False` when the caller has just done so): IntegrityError names the file.
    A LoRA run's checkpoint (an adapter) loads as its base model with the adapter merged in: a plain model,
    like any other checkpoint's (`trainer.lora`).
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    quiet_transformers_progress()
    if verify:
        verify_if_ours(name_or_path)

    cfg = cfg or ModelConfig()
    kwargs = {"dtype": DTYPES[cfg.dtype], "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = attention_implementation(cfg.attn_implementation)
    try:
        tokenizer = load_tokenizer(name_or_path, cfg)
        if is_adapter_dir(name_or_path):  # a LoRA run's checkpoint: its base with the adapter merged in
            base, _ = load_model(base_model_of(name_or_path), cfg, "cpu", verify=verify)
            model = merged_from(name_or_path, base)
        else:
            auto = AutoModelForImageTextToText if cfg.modality == "vision" else AutoModelForCausalLM
            model = auto.from_pretrained(name_or_path, **kwargs)
        if cfg.modality == "vision":
            tokenizer.vision = _vision_encoder(name_or_path, tokenizer, model.config, cfg)
    except OSError as e:
        raise OSError(
            f"could not load model {name_or_path!r}: {e}. Give a local checkpoint directory, or a hub "
            "id on a machine that can reach the hub."
        ) from e
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.to(device), tokenizer


# transformers' FlashAttention implementations and the package each imports; no grpoflow extra installs them
FLASH_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def load_tokenizer(name_or_path: str, cfg: ModelConfig | None = None):
    """The tokenizer of a model (what `load_model` returns beside it), for a process that needs only that (a
    multi-turn engine over vLLM renders the environment's messages with it)."""
    from transformers import AutoTokenizer

    cfg = cfg or ModelConfig()
    return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=cfg.trust_remote_code)


@functools.cache  # one warning per process, however many models it loads
def attention_implementation(requested: str) -> str:
    """`requested`, or "sdpa" with a warning when it is a FlashAttention whose package is not installed.

    flash-attn is compiled against the exact torch and CUDA of the machine (`pip install flash-attn
    --no-build-isolation`: minutes of compilation, or a prebuilt wheel matching both), which an extra cannot
    promise, so none installs it. PyTorch's own fused attention (sdpa) computes the same attention with what
    is installed: a recipe written for a node with flash-attn still runs on one without."""
    package = FLASH_PACKAGES.get(requested)
    if package is None or importlib.util.find_spec(package) is not None:
        return requested
    log.warning(
        "model.attn_implementation: %s needs the %r package, which is not installed here; using sdpa "
        "(PyTorch's fused attention) instead (flash-attn: pip install flash-attn --no-build-isolation)",
        requested,
        package,
    )
    return "sdpa"


def _vision_encoder(name_or_path: str, tokenizer, config, cfg: ModelConfig):
    """The image side of a vision model: its image processor on the PIL backend (the torchvision one, which
    `AutoProcessor` would also build for videos, does not import beside a CPU torch)."""
    from transformers import AutoImageProcessor

    from trainer.vision import VisionEncoder

    processor = AutoImageProcessor.from_pretrained(
        name_or_path, backend="pil", trust_remote_code=cfg.trust_remote_code
    )
    return VisionEncoder(processor, tokenizer, config)


def modality_of(path: str | Path) -> str:
    """'vision' for a model folder whose config has a vision tower (an image-text model), else 'text'."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return "text"
    return "vision" if "vision_config" in config else "text"


def verify_if_ours(name_or_path: str) -> None:
    """Check a grpoflow checkpoint or base model file by file against its manifest (IntegrityError naming the
    file); a plain HF folder or a hub id has nothing to check against and passes."""
    if _grpoflow_model(name_or_path):
        verify_output(name_or_path)


def _grpoflow_model(name_or_path: str) -> bool:
    manifest = Path(name_or_path) / MANIFEST
    try:
        found = json.loads(manifest.read_text()) if manifest.is_file() else None
    except (OSError, ValueError):
        return True  # unreadable: let verify_output name the problem
    return isinstance(found, dict) and found.get("kind") in ("checkpoint", "base-model")
