"""Stopping a diverging run before anything of the bad step is saved.

A non-finite loss or gradient norm stops the run before the optimizer update is applied; non-finite weights,
or weights whose forward overflows, right after it. Either way `NonFiniteError` names the step and the values;
under DDP all ranks stop together.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from trainer.rollout.batch import MicroBatch


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss, gradient norm or weights; nothing of that step is saved."""


def stop_unless_finite(
    values: dict[str, torch.Tensor], when: str, *, step: int, output_dir: Path, world: int
) -> None:
    """NonFiniteError naming `step` and those of `values` that are not finite (all ranks agree under DDP)."""
    flags = torch.stack([torch.isfinite(v.detach()).all() for v in values.values()]).to(torch.int32)
    if world > 1:
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)
    if bool(flags.all()):
        return
    bad = [
        f"{name} {v.item():g}" for (name, v), ok in zip(values.items(), flags.tolist(), strict=True) if not ok
    ]
    raise NonFiniteError(
        f"step {step}: non-finite {' and '.join(bad)} {when}; training stopped "
        f"before anything of this step was saved to {output_dir}. Lower "
        "train.learning_rate, or check the rewards and the data"
    )


# how far below float32's largest value a bound must stay for the probe forward to be left out: rounding in
# the forward's float32 sums adds well under 1% to the worst case, and a masked attention score (float32's
# lowest plus the score) must not round past it to -inf
_BOUND_MARGIN = 1e12


def forward_bound(model, largest: float) -> float | None:
    """An upper bound on the magnitude of every value in the forward of `model` (the norms' sums of squares
    included) when every weight lies within +-`largest`; None for a model it does not cover.

    It covers the pre-norm decoders `decode_step.supported` admits (float32 Qwen2 / Llama of transformers'
    own modules). There every sublayer reads its input through an RMSNorm, so that input is at most
    sqrt(hidden) times the norm's weight whatever the residual stream holds (one element of a vector of RMS r
    is at most sqrt(n) r); a projection of n inputs adds at most n such products and its bias; the rotary
    embedding at most doubles an element (times the rope's attention scaling); attention's output is a convex
    combination of the values; |silu(g)| <= |g|. The residual stream adds one attention and one MLP output
    per layer to the embedding. The bound is their largest, and the square of the residual's bound times
    hidden (the norm's sum of squares)."""
    from trainer.rollout.decode_step import supported

    if not supported(model):
        return None
    c = model.config
    hidden, layers = c.hidden_size, c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or hidden // c.num_attention_heads
    w = float(largest)
    normed = w * math.sqrt(hidden)  # a sublayer's input, and the last norm's output
    projected = hidden * w * normed + w  # q, k, v, gate and up
    rotated = 2 * projected * float(getattr(model.model.rotary_emb, "attention_scaling", 1.0))
    scores = head_dim * rotated * rotated  # before attention's 1/sqrt(head_dim), which only shrinks them
    attention = c.num_attention_heads * head_dim * w * projected + w  # o_proj of a convex combination of v
    gated = projected * projected  # silu(gate) * up
    mlp = c.intermediate_size * w * gated + w
    residual = w + layers * (attention + mlp)
    logits = hidden * w * normed + w
    return max(scores, gated, residual, residual * residual * hidden, logits)


@torch.no_grad()
def updated_policy_extremes(
    model, probe: MicroBatch | None, *, use_bound: bool = True
) -> dict[str, torch.Tensor]:
    """The largest |weight| of `model`, and the largest |logit| it gives on two sequences of `probe`: huge but
    finite weights can overflow in the forward, and the next rollout would fail on them. The probe forward
    runs in eval mode and draws no random numbers. It is left out when `forward_bound` proves that no value
    of the forward can overflow with these weights (the tiny model's: ~1e22 against float32's 3.4e38), which
    saves a forward of two sequences per update; `use_bound` False (ranks holding parts of the weights, whose
    own largest may differ) always runs it."""
    largest = torch.stack([p.abs().amax() for p in model.parameters()]).amax()  # NaN propagates
    logit = torch.zeros((), device=largest.device)
    if probe is not None and use_bound and torch.isfinite(largest):
        bound = forward_bound(model, largest.item())
        if bound is not None and bound < torch.finfo(torch.float32).max / _BOUND_MARGIN:
            probe = None
    if probe is not None:
        device, was_training = model.device, model.training
        model.eval()
        logits = model(
            input_ids=probe.input_ids[:2].to(device),
            attention_mask=probe.attention_mask[:2].to(device),
            position_ids=probe.position_ids[:2].to(device),
            use_cache=False,
        ).logits
        model.train(was_training)
        logit = logits.float().abs().amax().to(largest.device)
    return {"largest |weight|": largest, "largest |logit|": logit}


__all__ = ["NonFiniteError", "forward_bound", "stop_unless_finite", "updated_policy_extremes"]
