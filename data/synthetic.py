"""Built-in synthetic tasks for the embedded default: seeded, solvable by construction, no network.

Two kinds:
- `addition`: "What is a + b?" with a, b in [0, 99]. Short enough that a ~1M-parameter model trained
  for a few minutes on a CPU can partly solve it, which is what the embedded default needs: a base model
  that is neither hopeless nor done, so that GRPO has something to improve. A fixed tenth of the 10,000
  problems (chosen by hash) is the evaluation pool: its rows carry `split: heldout`, the others
  `split: train`, and the tiny base model is warmed up on the train pool only, so held-out accuracy is
  measured on problems no stage has trained on.
- `countdown`: three numbers and a target reachable with + - * / using each number once (the target is
  computed from a random expression over the numbers, so a solution exists).
- `multiplication`: "What is a * b?" with a, b in [10, 99], rows offering the `calculator` tool (column
  `tools`, `CALCULATOR_SCHEMA`): products the tiny model cannot work out in its head but can with the tool
  (the multi-turn demo). A tenth of the problems (by hash) are the evaluation pool, as for addition.
- `counting`: a PNG of 1-6 shapes (`data.shapes`) and "How many objects are there in the image?", for the
  embedded vision demo. A tenth of the rows (every tenth) come from the held-out image stream
  (`split: heldout`), which the tiny vision model's warm-up never draws from.

`worked_solution(row)` gives the reference completion in the `<think>…</think><answer>…</answer>`
format; it is what the tiny base model is warmed up on.
"""

from __future__ import annotations

import hashlib
import json
import random
from fractions import Fraction

from data.schema import CALCULATOR_SCHEMA

KINDS = ("addition", "countdown", "counting", "multiplication")
TOOL_KINDS = ("multiplication",)  # whose rows offer a tool
# The most rows one call generates: they are built in memory (a counting row holds its PNG, ~400 bytes), and a
# million is far past what any of these tasks needs (addition has 10,000 distinct problems).
MAX_ROWS = 1_000_000


POOLS = ("all", "train", "eval")


def in_eval_pool(a: int, b: int, op: str = "+") -> bool:
    return hashlib.sha256(f"{a}{op}{b}".encode()).digest()[0] % 10 == 0


def _multiplication(n: int, rng: random.Random, pool: str) -> list[dict]:
    pairs = [
        (a, b)
        for a in range(10, 100)
        for b in range(10, 100)
        if pool == "all" or in_eval_pool(a, b, "*") == (pool == "eval")
    ]
    rows = []
    while len(rows) < n:
        rng.shuffle(pairs)
        rows += [
            {
                "question": f"What is {a} * {b}?",
                "answer": str(a * b),
                "split": "heldout" if in_eval_pool(a, b, "*") else "train",
                "tools": [CALCULATOR_SCHEMA],
            }
            for a, b in pairs[: n - len(rows)]
        ]
    return rows


def _addition_row(a: int, b: int) -> dict:
    return {
        "question": f"What is {a} + {b}?",
        "answer": str(a + b),
        "split": "heldout" if in_eval_pool(a, b) else "train",
    }


def _addition(n: int, rng: random.Random, pool: str) -> list[dict]:
    pairs = [
        (a, b)
        for a in range(100)
        for b in range(100)
        if pool == "all" or in_eval_pool(a, b) == (pool == "eval")
    ]
    rows = []
    while len(rows) < n:  # distinct problems; cycle through reshuffles only when more are asked for
        rng.shuffle(pairs)
        rows += [_addition_row(a, b) for a, b in pairs[: n - len(rows)]]
    return rows


def _counting(n: int, seed: int) -> list[dict]:
    from data.shapes import QUESTION

    held = n // 10
    return [
        {"image": ref, "problem": QUESTION, "count": answer, "split": split}
        for split, count in (("train", n - held), ("heldout", held))
        for ref, answer in counting_row_images(count, seed, split)
    ]


def counting_row_images(n: int, seed: int, split: str) -> list[tuple[str, int]]:
    """`n` (PNG as a `data:` URI, count) pairs of one image stream (`data.shapes`), as prepared rows keep
    them."""
    import base64
    import io

    from data.shapes import counting_examples

    pairs = []
    for image, count in counting_examples(n, seed, split):
        png = io.BytesIO()
        image.save(png, format="PNG")
        pairs.append(("data:image/png;base64," + base64.b64encode(png.getvalue()).decode("ascii"), count))
    return pairs


def _countdown(rng: random.Random) -> dict:
    ops = "+-*/"
    while True:
        nums = [rng.randint(1, 30) for _ in range(3)]
        x, y, z = rng.sample(nums, 3)
        o1, o2 = rng.choice(ops), rng.choice(ops)
        inner = _apply(Fraction(x), Fraction(y), o1)
        if inner is None:
            continue
        value = _apply(inner, Fraction(z), o2)
        if value is None or value.denominator != 1 or not 1 <= value <= 200:
            continue
        expr = f"({x} {o1} {y}) {o2} {z}"
        return {
            "question": f"Using the numbers {nums}, create an equation that equals {int(value)}.",
            "answer": str(int(value)),
            "nums": nums,
            "target": int(value),
            "solution": expr,
        }


def _apply(x: Fraction, y: Fraction, op: str) -> Fraction | None:
    if op == "+":
        return x + y
    if op == "-":
        return x - y
    if op == "*":
        return x * y
    return None if y == 0 else x / y


def generate(n: int, seed: int, kind: str = "addition", pool: str = "all") -> list[dict]:
    """`n` rows of the given kind; the same (n, seed, kind, pool) always gives the same rows.

    `pool` (addition and multiplication) restricts problems to the train pool, the evaluation pool, or
    neither.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown synthetic kind {kind!r}; expected one of {', '.join(KINDS)}")
    if pool not in POOLS:
        raise ValueError(f"unknown pool {pool!r}; expected one of {', '.join(POOLS)}")
    if not 0 <= n <= MAX_ROWS:
        raise ValueError(f"rows must be between 0 and {MAX_ROWS:,}, got {n!r}")
    if kind == "counting":
        return _counting(n, seed)
    rng = random.Random(f"{kind}:{seed}")
    if kind == "addition":
        return _addition(n, rng, pool)
    if kind == "multiplication":
        return _multiplication(n, rng, pool)
    return [_countdown(rng) for _ in range(n)]


def worked_solution(row: dict) -> str:
    """The reference completion for a synthetic row, in the think/answer format."""
    if "nums" in row and "target" in row and "solution" in row:
        return f"<think>{row['solution']} = {row['target']}</think><answer>{row['solution']}</answer>"
    question = (
        row["question"]
        if "question" in row
        else next(m["content"] for m in row["prompt"] if m["role"] == "user")
    )
    if " * " in question:  # in the head: the tiny model mostly gets these wrong, which is the point
        a, b = (int(t) for t in question.removeprefix("What is ").removesuffix("?").split(" * "))
        return f"<think>{a}*{b}</think><answer>{a * b}</answer>"
    a, b = (int(t) for t in question.removeprefix("What is ").removesuffix("?").split(" + "))
    return f"<think>{a}+{b}={a + b}</think><answer>{a + b}</answer>"


def tool_transcript(row: dict) -> tuple[str, str, str]:
    """A multiplication row solved with the calculator: (the model's call, the tool's answer, the model's
    final turn), in Qwen2.5's tool-call format."""
    question = (
        row["question"]
        if "question" in row
        else next(m["content"] for m in row["prompt"] if m["role"] == "user")
    )
    a, b = (int(t) for t in question.removeprefix("What is ").removesuffix("?").split(" * "))
    call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} * {b}"}})
    return (
        f"<tool_call>\n{call}\n</tool_call>",
        str(a * b),
        f"<think>{a}*{b}={a * b}</think><answer>{a * b}</answer>",
    )
