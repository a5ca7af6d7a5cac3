"""Stopping a diverging run (trainer/divergence.py): the bound on a pre-norm decoder's forward that lets the
check after each update leave its probe forward out, by hand, against the forward's own values, and when
the probe still runs."""

from __future__ import annotations

import types

import pytest
import torch

from conftest import random_causal_lm
from trainer.divergence import forward_bound, updated_policy_extremes


def _model(architecture: str, hidden=32, heads=4, intermediate=48, layers=2, **extra):
    return random_causal_lm(
        architecture,
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        **extra,
    )


def test_the_bound_of_a_one_layer_qwen2_by_hand():
    model = _model("qwen2", hidden=4, heads=2, intermediate=8, layers=1, num_key_value_heads=2)
    # every weight within +-1: a normed input 1 * sqrt(4) = 2; q, k, v, gate, up 4 * 1 * 2 + 1 = 9; rotated
    # 18; scores 2 * 18 * 18 = 648; attention out 2 * 2 * 1 * 9 + 1 = 37; silu(gate) * up 81; MLP out
    # 8 * 1 * 81 + 1 = 649; residual 1 + 37 + 649 = 687; its squares' sum 687 ** 2 * 4 = 1,887,876 (the
    # largest); logits 4 * 1 * 2 + 1 = 9
    assert forward_bound(model, 1.0) == 1_887_876
    # within +-0.5: normed 1; projected 2.5; rotated 5; scores 50; attention 5.5; gated 6.25; MLP 25.5;
    # residual 31.5; squares' sum 31.5 ** 2 * 4 = 3,969
    assert forward_bound(model, 0.5) == 3_969


@pytest.mark.parametrize(
    "architecture, extra",
    [
        ("qwen2", {"num_key_value_heads": 4}),
        ("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
        ("llama", {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True}),
    ],
)
def test_every_value_of_the_forward_stays_within_the_bound(architecture, extra):
    """Every weight at +-3 (random signs: the worst magnitude everywhere): each module's output, and each
    norm's mean of squares, stays within the bound."""
    model = _model(architecture, **extra)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.where(torch.rand_like(p) < 0.5, -3.0, 3.0))
    bound = forward_bound(model, 3.0)
    assert bound is not None
    seen = []

    def record(module, inputs, output):
        for t in output if isinstance(output, tuple) else (output,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                seen.append(t.abs().max().item())
        if type(module).__name__.endswith("RMSNorm"):
            seen.append(inputs[0].pow(2).mean(-1).max().item())

    for module in model.modules():
        module.register_forward_hook(record)
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert seen and max(seen) <= bound and all(torch.isfinite(torch.tensor(seen)))


def _probe() -> types.SimpleNamespace:
    ids = torch.tensor([[5, 9, 13, 7], [0, 21, 8, 30]])
    mask = (ids != 0).long()
    return types.SimpleNamespace(input_ids=ids, attention_mask=mask, position_ids=mask.cumsum(-1) - 1)


def _counting_forwards(model) -> list:
    calls, forward = [], model.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    model.forward = counted  # not a hook: a hooked model is one the bound does not cover
    return calls


def test_the_probe_forward_runs_only_where_the_bound_cannot_rule_an_overflow_out():
    model = _model("qwen2", num_key_value_heads=4)
    calls = _counting_forwards(model)
    largest = max(p.abs().max().item() for p in model.parameters())

    extremes = updated_policy_extremes(model, _probe())  # ordinary weights: the bound rules it out
    assert calls == [] and extremes["largest |weight|"].item() == largest
    updated_policy_extremes(model, _probe(), use_bound=False)  # ranks holding shards always probe
    assert calls == [1]

    with torch.no_grad():  # huge but finite weights: the bound is past float32's range, the probe runs
        for p in model.parameters():
            p.mul_(1e10)
    assert forward_bound(model, largest * 1e10) > torch.finfo(torch.float32).max
    extremes = updated_policy_extremes(model, _probe())
    assert calls == [1, 1] and not torch.isfinite(extremes["largest |logit|"])


def test_a_model_the_bound_does_not_cover_is_always_probed():
    model = _model("qwen2", num_key_value_heads=4)
    model.model.layers[0].mlp.register_forward_hook(lambda *args: None)  # a hook may change any value
    assert forward_bound(model, 1.0) is None
    calls = _counting_forwards(model)
    updated_policy_extremes(model, _probe())
    assert calls == [1]
