"""The warm-up's pieces shared by the tiny text model (`trainer.bootstrap`) and the tiny vision model
(`trainer.tiny_vl`): the locally trained tokenizer, the worked solutions, and the supervised batches."""

from __future__ import annotations

import torch

from data import synthetic
from trainer.prompts import encode_prompts
from trainer.vision import VisionInputs, vision_forward_kwargs, vision_of

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]  # Qwen2.5's
TOOL_USE = "warmup_tool_use"  # a warm-up row's flag: its worked solution calls the tool
# Qwen-style: tool results are a user turn of <tool_response> blocks, as Qwen2.5's template writes them; the
# tools on offer are named in one short line after the system prompt (Qwen2.5 spends ~150 tokens on them).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' }}{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% if message['role'] == 'system' and tools %}{{ '\\nTools: ' }}"
    "{{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}{% endif %}"
    "<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(corpus: list[str], vocab_size: int, extra_tokens: list[str] = ()):
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
    fast.add_tokens(TAG_TOKENS + list(extra_tokens))  # plain added tokens: kept when decoding
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def sft_batches(model, tokenizer, rows: list[dict], batch_size: int, seed: int):
    """Endless seeded batches of (input_ids, attention_mask, labels, more forward inputs) with loss on what
    the model writes only (not on the prompt, nor on a tool's answer); a vision model's batches carry their
    images (`trainer.vision`)."""
    prompts = encode_prompts(tokenizer, rows)
    seqs, n_prompt, trained = [], [], []
    for p, row in zip(prompts, rows, strict=True):
        ids, mask = list(p), [False] * len(p)
        for text, learn in worked_segments(row, tokenizer):
            part = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += part
            mask += [learn] * len(part)
        seqs.append(ids)
        n_prompt.append(len(p))
        trained.append(torch.tensor(mask))
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
                labels[row, : len(s)] = torch.where(trained[i], s, -100)
            vision = VisionInputs.concat([vision_of(prompts[i]) for i in chosen])
            yield ids, mask, labels, (vision_forward_kwargs(model, ids, mask, vision) if vision else {})


def worked_segments(row: dict, tokenizer) -> list[tuple[str, bool]]:
    """The warm-up's target after the prompt, as (text, the model writes it) pieces: one piece (the worked
    solution and the end of turn), or for a row flagged `TOOL_USE` the tool call, the tool's answer as the
    chat template renders it (not learned), and the final turn."""
    eos = tokenizer.eos_token
    if not row.get(TOOL_USE):
        return [(worked_solution(row) + eos, True)]
    from trainer.multiturn.rollout import observation_text

    call, result, final = synthetic.tool_transcript(row)
    observed = observation_text(tokenizer, [{"role": "tool", "name": "calculator", "content": result}])
    return [(call + eos, True), (observed, False), (final + eos, True)]


def worked_solution(row: dict) -> str:
    """The warm-up's target completion for a row (a counting row answers in one short thought)."""
    if row.get("task") == "counting":
        return f"<think>I count the objects.</think><answer>{row['answer']}</answer>"
    if row.get(TOOL_USE):  # the whole exchange, as tokenizer-training text
        call, result, final = synthetic.tool_transcript(row)
        return f"{call}\n<tool_response>\n{result}\n</tool_response>{final}"
    return synthetic.worked_solution(row)
