"""Decoding attention over one copy of each prompt's KV cache, shared by the prompt's `n` completions.

GRPO samples `n` completions of every prompt. Repeating the prompt's cache `n` times makes each decoded
token read `n` copies of the same keys and values from memory; on a small model that reading is most of
the attention's time (the tiny recipe: 64 rows x ~38 prompt positions at every token). Here the prompts'
keys and values stay as the prefill made them, one row per prompt, and each completion's own tokens go to
a cache of their own; a decoded token's attention is the softmax over both parts, merged exactly (a common
max, one normaliser). The model's attention modules reach it through transformers' attention interface
(`AttentionInterface`), switched on for the decoding steps only; training and the prefill keep the model's
own implementation.

float32 text models whose every layer is full attention and whose attention goes through that interface
take this path (`supported`); others decode over the repeated cache as before.

Each part is in matrix products. PyTorch's CPU flash attention, which also returns each query's logsumexp
(what merging the parts needs), was measured for them (2026-12-06, 2 cores, the tiny model): a generation
of 4 prompts x 8 went 0.89-0.92x, but on two threads its prompt part took 1.6-2.1x the products' time for
16 prompts x 4, and one query per row over 128 or 256 own tokens took 0.96-1.8x (slower in 7 of the 8
shapes measured): not used.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

ATTENTION_KEY = "grpoflow_shared_prompt"


@dataclass
class PromptCache:
    """The prompts' keys and values per layer (prompts, kv heads, prompt positions, head dim), one row per
    prompt, and the additive mask of the left padding (prompts, 1, 1, positions: 0 or -inf)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    padding: torch.Tensor
    n: int  # completions per prompt; row r of the decoding batch belongs to prompt r // n

    @classmethod
    def from_prefill(cls, cache, attention_mask: torch.Tensor, n: int) -> PromptCache:
        padding = torch.zeros(
            attention_mask.shape, dtype=cache.layers[0].keys.dtype, device=attention_mask.device
        )
        padding = padding.masked_fill(attention_mask == 0, float("-inf"))[:, None, None, :]
        return cls(
            [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers], padding, n
        )


def shared_prompt_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs
):
    """Attention of one decoded token per row over its prompt's shared cache (`kwargs["prompt_cache"]`)
    and its own tokens so far (`key`, `value`: rows, kv heads, tokens, head dim). Returns
    (rows, 1, heads, head dim) as transformers' attention functions do, and no weights."""
    prompt: PromptCache | None = kwargs.get("prompt_cache")
    if prompt is None or query.shape[2] != 1:
        raise RuntimeError(
            f"{ATTENTION_KEY} attention decodes one token per row over a prompt cache; it was called with "
            f"{query.shape[2]} query positions and {'a' if prompt is not None else 'no'} prompt cache"
        )
    if sliding_window is not None or kwargs.get("softcap") is not None:
        raise RuntimeError(f"{ATTENTION_KEY} attention does not do sliding windows or logit soft-capping")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    layer = module.layer_idx
    pk, pv = prompt.keys[layer], prompt.values[layer]
    groups, kv_heads, _, dim = pk.shape
    rows, heads = query.shape[0], query.shape[1]
    rep, n = heads // kv_heads, prompt.n
    # the prompt part: each prompt's n x rep queries of a kv head in one matrix against its keys
    q = query.reshape(groups, n, kv_heads, rep, dim)
    q_prompt = q.permute(0, 2, 1, 3, 4).reshape(groups, kv_heads, n * rep, dim)
    s_prompt = torch.matmul(q_prompt, pk.transpose(-1, -2)).mul_(scaling).add_(prompt.padding)
    # a prompt of padding only has no max: its part then weighs 0
    m_prompt = s_prompt.amax(-1, keepdim=True).clamp_(min=torch.finfo(s_prompt.dtype).min)
    e_prompt = s_prompt.sub_(m_prompt).exp_()
    # groups, kv heads, n * rep, dim + 2: each query's weighted values, its normaliser and its max
    part = torch.cat([torch.matmul(e_prompt, pv), e_prompt.sum(-1, keepdim=True), m_prompt], dim=-1)
    part = (
        part.reshape(groups, kv_heads, n, rep, dim + 2).transpose(1, 2).reshape(rows, kv_heads, rep, dim + 2)
    )
    out_prompt, sum_prompt, m_prompt = part.split((dim, 1, 1), dim=-1)
    # the row's own tokens
    s_own = torch.matmul(query.reshape(rows, kv_heads, rep, dim), key.transpose(-1, -2)).mul_(scaling)
    m_own = s_own.amax(-1, keepdim=True)
    e_own = s_own.sub_(m_own).exp_()
    # both parts rescaled to the larger of their maxes: one softmax over prompt and own tokens
    m = torch.maximum(m_prompt, m_own)
    a, b = (m_prompt - m).exp_(), (m_own - m).exp_()
    out = (out_prompt * a).add_(torch.matmul(e_own, value).mul_(b))
    out = out.div_((sum_prompt * a).add_(e_own.sum(-1, keepdim=True).mul_(b)))
    return out.reshape(rows, heads, 1, dim).transpose(1, 2), None


@functools.cache
def register() -> None:
    from transformers import AttentionInterface

    # no mask function is registered under this key, so the model builds no attention mask while decoding
    AttentionInterface.register(ATTENTION_KEY, shared_prompt_attention)


def supported(model, cache) -> bool:
    """Whether `model` can decode with this attention after a prefill into `cache` (a DynamicCache): a
    float32 text model (no sub-configs) whose attention goes through transformers' interface, every layer
    full attention and every cache layer a plain DynamicLayer."""
    from transformers.cache_utils import DynamicLayer

    config = getattr(model, "config", None)
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if config is None or getattr(config, "sub_configs", None) or can_set is None or not can_set():
        return False
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return False
    if not cache.layers or not all(type(x) is DynamicLayer and x.is_initialized for x in cache.layers):
        return False
    # float32 only: in half precision this softmax would lose what SDPA's float accumulation keeps
    return cache.layers[0].keys.dtype == torch.float32


@contextlib.contextmanager
def decoding_attention(model):
    """The model's attention modules use the shared-prompt attention inside this block."""
    register()
    config = model.config
    before = config._attn_implementation_internal
    config._attn_implementation_internal = ATTENTION_KEY
    try:
        yield
    finally:
        config._attn_implementation_internal = before
