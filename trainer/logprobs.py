"""Log-probabilities of the completion tokens of a micro-batch under a model: the one forward that the loss,
the reference model, the GPU smoke check and the tests all use.

Two ways to the same numbers. `share_prompts=True` runs each distinct prompt once and indexes its KV cache
(with its autograd graph) out to the completions that share it, so a group of G completions costs one prompt
forward instead of G. The plain way runs each full sequence once: DDP needs it (one forward per backward),
and any wrapper that only forwards `forward` (DeepSpeed) accepts it.
"""

from __future__ import annotations

import torch

from trainer.loss import sequence_logps
from trainer.rollout.batch import MicroBatch
from trainer.rollout.hf_engine import cache_kwarg
from trainer.vision import vision_forward_kwargs


def completion_logps(
    model, mb: MicroBatch, temperature: float, *, share_prompts: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs [b, C] of `mb`'s completion tokens at `temperature`, and the logits they came from.

    Vision prompts always take the plain way: sharing their prefill would have to split the images by row. So
    does a model training under gradient checkpointing: transformers turns its KV cache off then, and the
    completions would be run without their prompt."""
    checkpointing = model.training and activation_checkpointing(model)
    share_prompts = share_prompts and mb.vision is None and not checkpointing
    logits = shared_prompt_logits(model, mb) if share_prompts else full_logits(model, mb)
    return sequence_logps(logits, mb.completion_ids, temperature), logits


def activation_checkpointing(model) -> bool:
    """Whether `model` recomputes its activations in backward. Newer transformers (5.24 here; not 5.19, the
    vLLM venv's) renamed the property, and the old name became an alias that warns at every read (every
    micro-batch), so the old name is read only where the new one is missing. Read through `getattr`, so
    that a wrapper forwarding attributes to its model (PEFT's LoRA model) answers for it; one that does not
    (DDP) counts as not checkpointing."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        value = getattr(model, name, None)
        if value is not None:
            return bool(value)
    return False


def full_logits(model, mb: MicroBatch) -> torch.Tensor:
    """Logits predicting each completion token, from one forward of the whole sequences."""
    c_len = mb.completion_ids.shape[1]
    inputs = {"position_ids": mb.position_ids}
    if mb.vision is not None:  # pixels, grids and the 3-D positions the rollout's prefill used
        inputs = vision_forward_kwargs(model, mb.input_ids, mb.attention_mask, mb.vision)
    out = model(
        input_ids=mb.input_ids,
        attention_mask=mb.attention_mask,
        logits_to_keep=c_len + 1,
        use_cache=False,
        **inputs,
    )
    return out.logits[:, :-1]


def shared_prompt_logits(model, mb: MicroBatch) -> torch.Tensor:
    """The same logits as `full_logits`, each distinct prompt run once and its KV cache shared by its rows."""
    from transformers import DynamicCache

    P, cache_kw = mb.prompt_width, cache_kwarg(model)
    mask, pos, firsts = mb.attention_mask, mb.position_ids, mb.prompt_rows
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=mb.input_ids[firsts, :P],
        attention_mask=mask[firsts, :P],
        position_ids=pos[firsts, :P],
        use_cache=True,
        logits_to_keep=1,
        **{cache_kw: cache},
    )
    first_logits = out.logits[:, -1].index_select(0, mb.prompt_inverse)
    for layer in cache.layers:  # each row its prompt's keys and values
        layer.keys, layer.values = _per_row(layer.keys, mb), _per_row(layer.values, mb)
    completion = mb.completion_ids
    if completion.shape[1] == 1:
        return first_logits[:, None]
    rest = model(
        input_ids=completion[:, :-1],
        attention_mask=mask[:, :-1],
        position_ids=pos[:, P:-1],
        use_cache=True,
        **{cache_kw: cache},
    ).logits
    return torch.cat([first_logits[:, None], rest], dim=1)


def _per_row(prompt_states: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Each row of `mb` its prompt's row of a prompt forward's keys or values (one row per distinct prompt),
    with a backward that adds the rows' gradients into their prompt's. Rows in whole runs per prompt (GRPO
    groups) take an expand, whose backward is a sum over the run: on the tiny model the same numbers to the
    last bit as index_select's backward (an index_add_ row by row; AVX2 and AVX-512 kernels,
    `tests/test_logprobs.py`), in 0.95-0.96x the time of a micro-batch's forward and backward (24 or 36 rows,
    2026-12-07). Not so for the prompts' last logits (a sum over 8 rows of 384 columns came out in another
    order), which stay indexed; so do rows not in whole runs (index_select's backward took half the time of
    indexing's index_put_, which DynamicCache.batch_select_indices uses)."""
    k = mb.prompt_repeats
    if k is None:
        return prompt_states.index_select(0, mb.prompt_inverse)
    shape = prompt_states.shape[1:]
    return prompt_states[:, None].expand(-1, k, *shape).reshape(-1, *shape)


__all__ = ["activation_checkpointing", "completion_logps", "full_logits", "shared_prompt_logits"]
