"""A tiny Qwen2-VL-architecture model, made locally (no hub): the vision path's test model and the start of
the embedded counting demo.

`make()` builds, and `build_tiny_vl(out)` writes in `save_pretrained` format, what a hub Qwen2-VL checkpoint
holds for our purposes: the model (a 2-block vision tower with patch 14, a 2-layer text model with M-RoPE), a
byte-level BPE tokenizer trained here with the image placeholder tokens and the think / answer tags, a
Qwen-style chat template, and the image processor's config (PIL backend, 56x56 to 112x112 pixels). Seeded
random weights; `trainer.bootstrap` warms it up on synthetic counting (`bootstrap.task: counting`) with the
pieces at the end of this module.
"""

from __future__ import annotations

from pathlib import Path

import torch

from data.schema import make_row
from data.shapes import QUESTION
from trainer.vision import PLACEHOLDER_TOKENS, VisionEncoder, save_tokenizer
from trainer.warmup import build_tokenizer
from trainer.warmup import sft_batches as _sft_batches

VIDEO_PAD = "<|video_pad|>"
CORPUS = [
    "How many objects are there in the image? <think> I count the shapes one by one. </think> "
    "<answer> 3 </answer>",
    "A conversation between User and Assistant. Think in <think> </think>, "
    "then answer in <answer> </answer>.",
    "user assistant system 0 1 2 3 4 5 6 7 8 9 red green blue yellow circle square triangle objects count",
]


def build_tiny_vl(
    out: str | Path, seed: int = 0, hidden_size: int = 64, layers: int = 2, merge: int = 1
) -> Path:
    """An untrained tiny model saved at `out` (the vision tests' model)."""
    model, tokenizer = make(seed, hidden_size, layers, merge)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    return out


def make(
    seed: int = 0,
    hidden_size: int = 64,
    layers: int = 2,
    merge: int = 1,
    corpus: list[str] = CORPUS,
    vocab_size: int = 400,
):
    """The model and its tokenizer (with `tokenizer.vision`, as `load_model` gives it), seeded, in memory.

    `merge` is the vision tower's spatial merge: 1 gives one token per 14-pixel patch (a 56x56 image is 16
    tokens), which a model this small needs to count: with Qwen's 2x2 merge a 2-layer model stayed at chance
    (0.17 for 1-6 objects after 400 warm-up steps), with 1 it passed 0.9 by step 225 (measured here)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = build_tokenizer(corpus * max(1, 2000 // len(corpus)), vocab_size=vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": [*PLACEHOLDER_TOKENS, VIDEO_PAD]})
    ids = dict(
        zip(
            [*PLACEHOLDER_TOKENS, VIDEO_PAD],
            tokenizer.convert_tokens_to_ids([*PLACEHOLDER_TOKENS, VIDEO_PAD]),
            strict=True,
        )
    )
    torch.manual_seed(seed)
    heads = max(1, hidden_size // 32)  # head_dim 32: the smallest vLLM's CPU attention takes
    half = (
        hidden_size // heads // 2
    )  # M-RoPE splits each head's rotary frequencies into time, height and width
    t = half // 4
    sections = [t, (half - t) // 2, half - t - (half - t) // 2]
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": True,
            "bos_token_id": tokenizer.convert_tokens_to_ids("<|im_start|>"),
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections},
        },
        vision_config={
            "depth": 2,
            "embed_dim": hidden_size // 2,
            "hidden_size": hidden_size,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": merge,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        tie_word_embeddings=True,
    )
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, merge_size=merge)
    tokenizer.vision = VisionEncoder(processor, tokenizer, config)
    return model, tokenizer


# ---- the warm-up's pieces, for `trainer.bootstrap` (task: counting) ----------------------------------------


def rows(task: str, n: int, seed: int, pool: str, system_prompt: str) -> list[dict]:
    """`n` counting rows from the train image stream, or (pool 'eval') the held-out one GRPO evaluates on."""
    from data.synthetic import counting_row_images

    split = "heldout" if pool == "eval" else "train"
    return [
        make_row(f"boot-{pool}-{i}", QUESTION, str(count), "counting", system_prompt, images=[ref])
        for i, (ref, count) in enumerate(counting_row_images(n, seed, split))
    ]


def build(cfg, train_rows: list[dict], system_prompt: str):
    corpus = [
        f"{system_prompt} {QUESTION} <think>I count the objects.</think><answer>{n}</answer>"
        for n in range(10)
    ]
    return make(cfg.seed, cfg.hidden_size, cfg.num_layers, corpus=corpus + CORPUS, vocab_size=cfg.vocab_size)


sft_batches = _sft_batches


__all__ = ["build", "build_tiny_vl", "make", "rows", "sft_batches"]
