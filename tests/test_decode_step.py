"""The decoding step written out as tensor operations (trainer/rollout/decode_step.py): exactly the model's
forward, and only for the models it mirrors."""

from __future__ import annotations

import pytest
import torch

from conftest import random_causal_lm
from trainer.rollout import decode_step
from trainer.rollout.base import SamplingParams
from trainer.rollout.hf_engine import HFEngine

VOCAB = 64


def _model(architecture: str, **extra):
    model = random_causal_lm(architecture, vocab_size=VOCAB, **extra)
    with torch.no_grad():  # weights large enough that the logits spread (random init is near uniform)
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    return model


class _Tokenizer:
    """What HFEngine reads of a tokenizer: pad and eos ids, and decode."""

    pad_token_id, eos_token_id = 0, 2

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


EOS = [2, 3, 4, 5]  # several, so that some completions stop early
PROMPTS = [[5, 9, 13], [7, 21, 8, 30, 11, 3], [40]]  # ragged: left padding in the prompt cache

ARCHITECTURES = [
    ("qwen2", {"num_key_value_heads": 4}),
    ("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    ("llama", {"num_key_value_heads": 1}),
    ("llama", {"num_key_value_heads": 2, "attention_bias": True, "mlp_bias": True}),
]


@pytest.mark.parametrize(("architecture", "extra"), ARCHITECTURES)
def test_written_out_decoding_is_bit_identical_to_the_models_forward(architecture, extra, monkeypatch):
    """Sampled tokens and their log-probs, decoded through `decode_logits`, equal to the last bit those of
    the model's own forward (same seed), over ragged prompts, grouped-query attention, biases, tied
    embeddings, EOS stops and a generation past the completions' first 64 reserved cache positions."""
    model = _model(architecture, **extra)
    engine = HFEngine(model, _Tokenizer(), eos_token_ids=EOS)
    assert decode_step.supported(model)
    for max_tokens, ignore_eos in ((1, False), (12, False), (80, True)):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=3, ignore_eos=ignore_eos)
        decoding = engine.start(PROMPTS, 4, params)
        assert decoding.written_out  # the written-out path was taken
        decoding.step()
        written = decoding.results()
        with monkeypatch.context() as patch:
            patch.setattr(decode_step, "supported", lambda model: False)
            reference = engine.start(PROMPTS, 4, params)
            assert not reference.written_out and reference.prompt_cache is not None
            reference.step()
            reference = reference.results()
        lengths = set()
        for group, group_reference in zip(written, reference, strict=True):
            for completion, expected in zip(group, group_reference, strict=True):
                assert completion.token_ids == expected.token_ids
                assert completion.logprobs == expected.logprobs  # float equality: bit-identical
                assert completion.finish_reason == expected.finish_reason
                lengths.add(len(completion.token_ids))
        if max_tokens == 12:  # some stopped at EOS, some ran to the limit
            assert len(lengths) > 1
        if ignore_eos:
            assert lengths == {max_tokens}


def test_models_it_does_not_mirror_decode_through_their_own_forward():
    """A forward hook, LoRA-wrapped projections, half precision or another architecture: not supported, and
    the engine still decodes them (through the model's forward)."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    hooked = _model("qwen2", num_key_value_heads=2)
    hooked.lm_head.register_forward_hook(lambda module, args, out: out)
    lora = get_peft_model(
        _model("qwen2", num_key_value_heads=2), LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    )
    half = _model("llama", num_key_value_heads=2).to(torch.bfloat16)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)).eval()
    for model in (hooked, lora, lora.base_model.model, half, gpt2):
        assert not decode_step.supported(model), type(model).__name__
    for model in (hooked, lora.base_model.model, half):
        engine = HFEngine(model, _Tokenizer(), eos_token_ids=EOS)
        groups = engine.generate(PROMPTS, 2, SamplingParams(max_tokens=4, temperature=1.0, seed=0))
        assert [len(g) for g in groups] == [2, 2, 2]
        assert all(1 <= len(c.token_ids) <= 4 for g in groups for c in g)
