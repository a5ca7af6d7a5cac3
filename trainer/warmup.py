"""The warm-up's pieces shared by the tiny text model (`trainer.bootstrap`) and the tiny vision model
(`trainer.tiny_vl`): the locally trained tokenizer, the worked solutions, and the supervised batches."""

from __future__ import annotations

import torch

from data import synthetic
from trainer.prompts import encode_prompts
from trainer.vision import VisionInputs, vision_forward_kwargs, vision_of

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(corpus: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # The tags are added afterwards as plain tokens: as special tokens, decoding would drop them.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.add_tokens(TAG_TOKENS)  # plain added tokens: kept when decoding with skip_special_tokens
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def sft_batches(model, tokenizer, rows: list[dict], batch_size: int, seed: int):
    """Endless seeded batches of (input_ids, attention_mask, labels, more forward inputs) with loss on the
    completion only; a vision model's batches carry their images (`trainer.vision`)."""
    prompts = encode_prompts(tokenizer, rows)
    completions = tokenizer(
        [worked_solution(r) + tokenizer.eos_token for r in rows], add_special_tokens=False
    )["input_ids"]
    seqs = [p + c for p, c in zip(prompts, completions, strict=False)]
    n_prompt = [len(p) for p in prompts]
    gen = torch.Generator().manual_seed(seed)
    while True:
        for idx in torch.randperm(len(seqs), generator=gen).split(batch_size):
            chosen = idx.tolist()
            width = max(len(seqs[i]) for i in chosen)
            ids = torch.full((len(chosen), width), tokenizer.pad_token_id)
            mask = torch.zeros_like(ids)
            labels = torch.full_like(ids, -100)
            for row, i in enumerate(chosen):
                s = torch.tensor(seqs[i])
                ids[row, : len(s)] = s
                mask[row, : len(s)] = 1
                labels[row, n_prompt[i] : len(s)] = s[n_prompt[i] :]
            vision = VisionInputs.concat([vision_of(prompts[i]) for i in chosen])
            yield ids, mask, labels, (vision_forward_kwargs(model, ids, mask, vision) if vision else {})


def worked_solution(row: dict) -> str:
    """The warm-up's target completion for a row (a counting row answers in one short thought)."""
    if row.get("task") == "counting":
        return f"<think>I count the objects.</think><answer>{row['answer']}</answer>"
    return synthetic.worked_solution(row)
