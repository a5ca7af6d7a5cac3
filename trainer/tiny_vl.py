"""A tiny Qwen2-VL-architecture model, made locally (no hub): the vision path's test model and the start of the
embedded counting demo.

`build_tiny_vl(out, seed)` writes, in `save_pretrained` format, exactly what a hub Qwen2-VL checkpoint holds
for our purposes: the model (a 1-block vision tower with patch 14 and 2x2 merge, a 2-layer text model with
M-RoPE), a byte-level BPE tokenizer trained here with the image placeholder tokens and the think / answer tags,
a Qwen-style chat template, and the image processor's config (PIL backend; 56x56 to 112x112 pixels, so an
image is 4 to 16 tokens). It is untrained: seeded random weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.bootstrap import build_tokenizer
from trainer.vision import PLACEHOLDER_TOKENS

VIDEO_PAD = "<|video_pad|>"
CORPUS = [
    "How many objects are there in the image? <think> I count the shapes one by one. </think> <answer> 3 </answer>",
    "A conversation between User and Assistant. Think in <think> </think>, then answer in <answer> </answer>.",
    "user assistant system 0 1 2 3 4 5 6 7 8 9 red green blue yellow circle square triangle objects count",
]


def build_tiny_vl(out: str | Path, seed: int = 0, hidden_size: int = 64, layers: int = 2, vision_dim: int = 32,
                  vision_depth: int = 1, merge: int = 2) -> Path:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Path(out)
    tokenizer = build_tokenizer(CORPUS * 20, vocab_size=400)
    tokenizer.add_special_tokens({"additional_special_tokens": [*PLACEHOLDER_TOKENS, VIDEO_PAD]})
    ids = dict(zip([*PLACEHOLDER_TOKENS, VIDEO_PAD], tokenizer.convert_tokens_to_ids([*PLACEHOLDER_TOKENS, VIDEO_PAD]),
                   strict=True))
    torch.manual_seed(seed)
    heads = max(1, hidden_size // 32)  # head_dim 32: the smallest vLLM's CPU attention takes
    half = hidden_size // heads // 2  # M-RoPE splits each head's rotary frequencies into time, height and width
    t = half // 4
    sections = [t, (half - t) // 2, half - t - (half - t) // 2]
    config = Qwen2VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
                     "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
                     "max_position_embeddings": 1024, "tie_word_embeddings": True,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                         "mrope_section": sections}},
        vision_config={"depth": vision_depth, "embed_dim": vision_dim, "hidden_size": hidden_size, "num_heads": 2, "mlp_ratio": 2,
                       "patch_size": 14, "spatial_merge_size": merge, "temporal_patch_size": 2},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"), tie_word_embeddings=True,
    )
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, merge_size=merge).save_pretrained(out)
    return out


__all__ = ["build_tiny_vl"]
