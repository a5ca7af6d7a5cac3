"""One decoding step of a Qwen2- or Llama-architecture model, written out as its tensor operations.

A generation runs the model's forward for one token per row at every step. On a small model the Python
around each operation (nested module calls, keyword plumbing, decorators, mask builders, output classes)
is a large share of that step: on the tiny recipe's model a whole generation takes 0.84-0.92x the time
written out (4 prompts x 8, two threads) and 0.92-0.93x (16 x 4, one thread, as the asynchronous rollout
worker runs it; `tests/benchmarks/test_bench_decode.py`), the rest being the matrix products themselves.
`decode_logits` runs the operations of transformers' `Qwen2ForCausalLM` / `LlamaForCausalLM` forward for
that case, in the same order on the same tensors (RMSNorm, projections, rotary embedding, cache update,
attention, MLP, final norm, LM head), without the layers around them, so its logits are bit-identical to the
model's (`tests/test_decode_step.py` checks the sampled tokens and their log-probs against the model's
forward, under transformers 5.24 and 5.19). The shared-prompt decoding
(`hf_engine.Decoding`, `shared_prompt.py`) takes this path for models `supported` admits; anything else
(other architectures, LoRA-wrapped or quantized projections, modules with hooks, half precision) decodes
through the model's own forward.

The projections stay separate products: one product over the query, key and value weights joined (and one
over gate and up) would save a third of a layer's products, but MKL sums a 48-column product differently
from 32 + 8 + 8 columns (a Llama layer with one key-value head, 2026-12-07), so the logits would no longer
match the model's to the bit. Measured and not taken (2026-12-07, AMD Zen 4, 2 threads): the rotary
embedding of the queries and keys in one product with a roll (the same bits) took 0.985-0.99x a generation;
this step under `torch.compile(dynamic=True)` took 0.65x (4 prompts x 8) and 0.80x (16 x 4, the tiny
recipe's) with logits a rounding away from the model's, but compiling took 38 s on a fresh machine and 9 s
with inductor's cache warm, about what it saves over the recipe's 1,400 steps (24 ms each).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

# the classes whose forward `decode_logits` mirrors, per architecture prefix
_ARCHITECTURES = ("Qwen2", "Llama")


def supported(model) -> bool:
    """Whether `decode_logits` computes exactly what `model`'s forward would: a float32 Qwen2 or Llama causal
    LM built of transformers' own modules (plain `nn.Linear` projections, the architecture's RMSNorm,
    attention, MLP and decoder layer classes) with no forward hooks on any of them."""
    prefix = type(model).__name__.removesuffix("ForCausalLM")
    inner = getattr(model, "model", None)
    if prefix not in _ARCHITECTURES or type(inner).__name__ != f"{prefix}Model":
        return False
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return False
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return False
    if type(model.lm_head) is not nn.Linear or type(inner.embed_tokens) is not nn.Embedding:
        return False
    if model.lm_head.weight.dtype != torch.float32 or not _is(inner.norm, f"{prefix}RMSNorm"):
        return False
    for layer in inner.layers[: model.config.num_hidden_layers]:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        expected = (
            (layer, f"{prefix}DecoderLayer"),
            (attention, f"{prefix}Attention"),
            (mlp, f"{prefix}MLP"),
            (getattr(layer, "input_layernorm", None), f"{prefix}RMSNorm"),
            (getattr(layer, "post_attention_layernorm", None), f"{prefix}RMSNorm"),
        )
        if not all(_is(module, name) for module, name in expected):
            return False
        linears = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj)
        if not all(type(m) is nn.Linear for m in (*linears, mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            return False
        if getattr(attention, "sliding_window", None) is not None:
            return False
    return True


def _is(module, class_name: str) -> bool:
    return type(module).__name__ == class_name


def _rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    # Qwen2RMSNorm / LlamaRMSNorm in float32 (their casts to and from float32 are no-ops there)
    variance = x.pow(2).mean(-1, keepdim=True)
    return norm.weight * (x * torch.rsqrt(variance + norm.variance_epsilon))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


Attention = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def decode_logits(
    model, tokens: torch.Tensor, positions: torch.Tensor, cache, attention: Attention
) -> torch.Tensor:
    """Logits [rows, vocab] after one token per row: `tokens` and `positions` [rows]; `cache` (a
    DynamicCache) takes this step's keys and values (`cache.update`) and gives back each layer's keys and
    values so far; `attention(module, query, keys, values)` returns (rows, 1, heads, head dim), as a
    transformers attention function does. `model` must be `supported`."""
    inner = model.model
    hidden = inner.embed_tokens(tokens[:, None])
    cos, sin = inner.rotary_emb(hidden, positions[:, None])
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rows = tokens.shape[0]
    for layer in inner.layers[: model.config.num_hidden_layers]:
        attn, mlp = layer.self_attn, layer.mlp
        residual = hidden
        x = _rms_norm(hidden, layer.input_layernorm)
        shape = (rows, 1, -1, attn.head_dim)
        q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(shape).transpose(1, 2)
        k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(shape).transpose(1, 2)
        v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(shape).transpose(1, 2)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        k, v = cache.update(k, v, attn.layer_idx)
        out = attention(attn, q, k, v).reshape(rows, 1, -1).contiguous()
        hidden = residual + F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
        residual = hidden
        x = _rms_norm(hidden, layer.post_attention_layernorm)
        gate = mlp.act_fn(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias))
        up = F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
        hidden = residual + F.linear(gate * up, mlp.down_proj.weight, mlp.down_proj.bias)
    hidden = _rms_norm(hidden, inner.norm)
    return F.linear(hidden, model.lm_head.weight, model.lm_head.bias)[:, -1]


__all__ = ["decode_logits", "supported"]
