"""Loading a policy by hub id, local path, or 'bootstrap' (the embedded default's tiny model)."""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.recipe import Recipe

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def resolve_model_path(recipe: Recipe, make_bootstrap: bool = True) -> str:
    """The path or hub id to load; 'bootstrap' is made on first use (cached by its config hash)."""
    name = recipe.model.name_or_path
    if name != "bootstrap":
        return name
    from trainer.bootstrap import bootstrap

    if not make_bootstrap:
        return str(Path(recipe.bootstrap.out).resolve())
    return bootstrap(recipe.bootstrap, system_prompt=recipe.data.system_prompt)["path"]


def load_policy(name_or_path: str, recipe: Recipe, device: str | torch.device = "cpu"):
    """Model and tokenizer through transformers' Auto classes, exactly as for any hub model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"dtype": DTYPES[recipe.model.dtype], "trust_remote_code": recipe.model.trust_remote_code}
    if recipe.model.attn_implementation:
        kwargs["attn_implementation"] = recipe.model.attn_implementation
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=recipe.model.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    except OSError as e:
        raise OSError(f"could not load model {name_or_path!r}: {e}. Give a local checkpoint directory, or a hub "
                      "id on a machine that can reach the hub.") from e
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.to(device), tokenizer
