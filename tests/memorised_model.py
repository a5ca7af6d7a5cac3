"""A tiny model that is right on purpose, so that evaluation tests see scores other than zero.

The tiny base model solves no MATH-500 or AIME problem: a real evaluation of it scores 0 everywhere, and a
comparison, a gate, pass@k or the thinking metrics of its work dir only ever see zeros.
`train_memorising_model` over-trains a copy of it on a fixed handful of problems, prompted as EvalScope
prompts them, until it answers each with the same `<think>` section and `\\boxed{}` answer (`completion`). A
real EvalScope run of it then has known scores problem by problem (1 on a memorised problem, 0 on the others
of `evaluated_problems`) and known outputs, whose thinking metrics can be counted by hand.

`COIN` is one more AIME problem, outside the first `LIMIT`, trained with its right answer and a wrong one in
equal measure: sampled at temperature 1 it is right about half the time, so pass@k differs from the mean
accuracy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

BENCHMARKS = ["math_500", "aime24"]
LIMIT = 2  # EvalScope's limit is per subset: 2 problems of each MATH-500 level, the first 2 AIME problems
MAX_TOKENS = 64  # the longest memorised completion is 60 tokens and its EOS with the tiny tokenizer
LEARNING_RATE = 3e-3
# One of the first LIMIT problems of MATH-500 levels 1, 3, 4 and 5 (level 2's two have long answers, so none
# of it) and the second AIME problem; the other evaluated problems are unknown to the model. No answer of one
# evaluated problem is the answer of another, so the model cannot be right by accident.
MEMORISED = {
    "math_500": (
        "test/intermediate_algebra/134.json",
        "test/number_theory/572.json",
        "test/precalculus/927.json",
        "test/intermediate_algebra/1994.json",
    ),
    "aime24": ("61",),
}
COIN = ("63", "386")  # AIME 2024 problem 63 (answer 385) and the wrong answer it is also taught

# EvalScope's prompt templates (its math_500 and aime adapters); a test checks them against EvalScope's
# reviews
PROMPTS = {
    "math_500": "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    "aime24": "\nSolve the following math problem step by step. Put your answer inside \\boxed{{}}.\n\n"
    "{question}\n\nRemember to put your answer inside \\boxed{{}}.",
}


@dataclass(frozen=True)
class Problem:
    benchmark: str
    # the id `evaluation.compare.load_samples` pairs on: MATH-500's unique_id, else "<subset>/<place>"
    key: str
    subset: str
    question: str
    answer: str
    memorised: bool

    @property
    def prompt(self) -> str:
        return PROMPTS[self.benchmark].format(question=self.question)


def reasoning(answer: str) -> str:
    """The memorised thinking: the answer is reached in its second of three paragraphs."""
    return f"I think.\n\nThe answer is \\boxed{{{answer}}}.\n\nThen I check."


def completion(answer: str) -> str:
    return f"<think>{reasoning(answer)}</think>\\boxed{{{answer}}}"


def _rows(data: Path, bench: str) -> list[dict]:
    return [
        json.loads(line) for line in (data / bench / "test.jsonl").read_text().splitlines() if line.strip()
    ]


def evaluated_problems(data: Path, limit: int = LIMIT) -> list[Problem]:
    """The problems an EvalScope run of `BENCHMARKS` with `limit` scores: the first `limit` of each subset, in
    the file's order (MATH-500's subsets are its levels)."""
    problems = []
    math = _rows(data, "math_500")
    for level in range(1, 6):
        for row in [r for r in math if r["level"] == level][:limit]:
            problems.append(
                Problem(
                    "math_500",
                    row["unique_id"],
                    f"Level {level}",
                    row["problem"],
                    row["answer"],
                    row["unique_id"] in MEMORISED["math_500"],
                )
            )
    for index, row in enumerate(_rows(data, "aime24")[:limit]):
        problems.append(
            Problem(
                "aime24",
                f"default/{index}",
                "default",
                row["problem"],
                row["answer"],
                str(row["id"]) in MEMORISED["aime24"],
            )
        )
    return problems


def coin_problem(data: Path) -> Problem:
    index, row = next((i, r) for i, r in enumerate(_rows(data, "aime24")) if str(r["id"]) == COIN[0])
    return Problem("aime24", f"default/{index}", "default", row["problem"], row["answer"], True)


def training_pairs(data: Path) -> list[tuple[str, str]]:
    """(prompt, completion) pairs: every memorised problem once, the coin problem with each of its two
    answers."""
    pairs = [(p.prompt, completion(p.answer)) for p in evaluated_problems(data) if p.memorised]
    coin = coin_problem(data)
    return pairs + [(coin.prompt, completion(coin.answer)), (coin.prompt, completion(COIN[1]))]


def reviews(result) -> dict[tuple[str, str], dict]:
    """EvalScope's reviews of an evaluation read straight from its files: (benchmark, problem id) ->
    review."""
    found = {}
    for bench, paths in result.review_paths.items():
        for path in paths:
            subset = path.stem.removeprefix(f"{bench}_")
            for line in path.read_text().splitlines():
                review = json.loads(line)
                score = review["sample_score"]
                key = score["sample_metadata"].get("question_id") or f"{subset}/{score['group_id']}"
                found[bench, key] = review
    return found


def text_of(message: dict) -> str:
    """The model's whole output: EvalScope hands back a `<think>` section as a reasoning block beside the
    text."""
    content = message["content"]
    if isinstance(content, str):
        return content
    blocks = {block["type"]: block for block in content}
    return f"<think>{reasoning_of(message)}</think>{blocks['text']['text']}"


def reasoning_of(message: dict) -> str:
    """The `<think>` section of a recorded output, which EvalScope keeps as the message's one reasoning
    block."""
    [block] = [b for b in message["content"] if b["type"] == "reasoning"]
    return block["reasoning"]


def eval_overrides(data: Path) -> list[str]:
    """The recipe overrides of an evaluation on `evaluated_problems`: greedy, `LIMIT` per subset,
    `MAX_TOKENS`."""
    paths = ", ".join(f"{b}: {data / b}" for b in BENCHMARKS)
    return [
        f"eval.benchmarks=[{', '.join(BENCHMARKS)}]",
        f"eval.local_paths={{{paths}}}",
        f"eval.limit={LIMIT}",
        f"eval.max_tokens={MAX_TOKENS}",
        "eval.repeats=1",
        "eval.temperature=0",
    ]


def evaluate_known_problems(model: str, data: Path, work_dir: Path):
    """`model` evaluated on `evaluated_problems` through the one evaluation entry point
    (`evaluation.evaluate`)."""
    from evaluation import evaluate
    from trainer.recipe import load_recipe

    return evaluate(model, load_recipe(None, eval_overrides(data)).eval, work_dir=work_dir, progress=False)


def train_memorising_model(base: str | Path, out: Path, data: Path, max_steps: int = 300) -> Path:
    """Over-train the model at `base` on `training_pairs` and save it (model and tokenizer) to `out`.

    Training stops once greedy decoding reproduces every memorised completion with a margin: teacher-forced,
    each next token is the most likely one with probability over 0.9, but at the coin problem's branch, where
    each of its two answers keeps over 0.3. RuntimeError if that is not reached within `max_steps`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    pairs = training_pairs(data)
    seqs = [_sequence(tokenizer, prompt, answer) for prompt, answer in pairs]
    n_labels = sum(len(labels) for _, labels, _ in seqs)
    optim = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    model.train()
    for _ in range(max_steps):
        probs = []
        for ids, labels, start in seqs:  # one sequence at a time: no padding, which would cost as much again
            logits = model(input_ids=ids.unsqueeze(0)).logits[0, start - 1 : -1]
            loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum") / n_labels
            loss.backward()
            probs.append(logits.detach().softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        if _memorised(seqs, probs):
            break
    else:
        raise RuntimeError(
            f"the memorising model did not learn its {len(pairs)} completions in {max_steps} steps"
        )
    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _sequence(tokenizer, prompt: str, answer: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(prompt + completion + EOS token ids, the completion's and EOS's ids, where the completion starts); the
    prompt chat-templated as EvalScope's checkpoint mode and the server template it."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return torch.tensor(prompt_ids + answer_ids), torch.tensor(answer_ids), len(prompt_ids)


def _memorised(seqs: list, probs: list[torch.Tensor]) -> bool:
    """Whether every next token of every completion has probability over 0.9, but where the coin problem's two
    completions (the last two) part: there each keeps over 0.3."""
    branch = int((seqs[-2][1] != seqs[-1][1]).nonzero()[0])
    confident = [p > 0.9 for p in probs]
    for coin in confident[-2:]:
        coin[branch] = True
    return (
        all(bool(c.all()) for c in confident)
        and bool(probs[-2][branch] > 0.3)
        and bool(probs[-1][branch] > 0.3)
    )
