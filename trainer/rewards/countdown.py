"""The `countdown` reward: is the answer an arithmetic expression over the given numbers that hits the target?

Model text is never executed: a small recursive-descent parser reads the expression and evaluates it with
`fractions.Fraction`, so `4/3*3` is exactly 4 and nothing the model writes can run.

Accepted (anything else is 0.0):
- the final answer as `data.answers.extract_answer` reads it for every reward (the last `<answer>` block,
  else the last `\\boxed{}`);
- ASCII digits, `+ - * / ( )` and spaces only, at most `MAX_EXPRESSION_CHARS` characters and `MAX_LITERALS`
  numbers; no `**`, no unicode digits, no decimals;
- binary operators only: no unary minus or plus, since a countdown expression combines the given numbers and
  `-3` is not one of them;
- every given number used exactly once (multiset equality of the integer literals with `nums`);
- optionally one trailing `= <target>` whose right-hand side is the target itself;
- every intermediate value bounded (`MAX_ABS` for numerator and denominator), division by zero rejected.

The gold columns are `nums` (a list of integers per row) and `target` (an integer); a row whose columns are
not integers gets None, as it is the data's fault, not the model's.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

from data.answers import extract_answer
from trainer.rewards.parsing import completion_texts
from trainer.rewards.runner import bounds_own_work

MAX_EXPRESSION_CHARS = 256
MAX_ABS = 10**12
MAX_LITERALS = 32
MAX_DEPTH = 32  # parentheses nesting; keeps the recursion shallow whatever the input

_ALLOWED = frozenset("0123456789+-*/() =")
_TOKEN = re.compile(r"[0-9]+|[-+*/()]")


class CountdownRejected(ValueError):
    """The answer is not an acceptable countdown expression; the message says why."""


@bounds_own_work
def countdown_reward(
    prompts: Sequence, completions: Sequence, nums: Sequence, target: Sequence, **_columns
) -> list[float | None]:
    """1.0 if the final answer is an expression using each of `nums` exactly once and equal to `target`;
    else 0.0."""
    rewards: list[float | None] = []
    for text, row_nums, row_target in zip(completion_texts(completions), nums, target, strict=True):
        gold = _gold(row_nums, row_target)
        if gold is None:
            rewards.append(None)
            continue
        answer = extract_answer(text)
        rewards.append(1.0 if answer is not None and solves(answer, *gold) else 0.0)
    return rewards


def solves(answer: str, nums: Sequence[int], target: int) -> bool:
    """Whether `answer` is an acceptable expression over `nums` equal to `target`."""
    try:
        value, literals = evaluate_expression(answer, target)
    except CountdownRejected:
        return False
    return value == target and Counter(literals) == Counter(nums)


def evaluate_expression(answer: str, target: int | None = None) -> tuple[Fraction, list[int]]:
    """Exact value of a countdown expression and the integer literals it uses, in order.

    A trailing `= N` is accepted only if N equals `target`. Raises CountdownRejected on anything else.
    """
    text = answer.strip()
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CountdownRejected(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    bad = sorted(set(text) - _ALLOWED)
    if bad:
        raise CountdownRejected(f"characters not allowed: {''.join(bad)!r}")
    if "=" in text:
        text, _, rhs = text.partition("=")
        rhs = rhs.strip()
        if not rhs.isdigit() or target is None or int(rhs) != target:
            raise CountdownRejected(f"right-hand side {rhs!r} is not the target")
    return _Parser(text).parse()


class _Parser:
    """expr := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ; factor := INT | '(' expr ')'"""

    def __init__(self, text: str):
        self.tokens = _tokenize(text)
        self.pos = 0
        self.depth = 0
        self.literals: list[int] = []

    def parse(self) -> tuple[Fraction, list[int]]:
        value = self.expr()
        if self.pos != len(self.tokens):
            raise CountdownRejected(f"unexpected {self.tokens[self.pos]!r} at token {self.pos}")
        return value, self.literals

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise CountdownRejected("expression ends too early")
        self.pos += 1
        return token

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            value = _bounded(value + self.term() if op == "+" else value - self.term())
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in ("*", "/"):
            op = self.take()
            right = self.factor()
            if op == "/" and right == 0:
                raise CountdownRejected("division by zero")
            value = _bounded(value * right if op == "*" else value / right)
        return value

    def factor(self) -> Fraction:
        token = self.take()
        if token == "(":
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise CountdownRejected(f"parentheses nested deeper than {MAX_DEPTH}")
            value = self.expr()
            if self.take() != ")":
                raise CountdownRejected("unbalanced parentheses")
            self.depth -= 1
            return value
        if token.isdigit():
            number = int(token)
            self.literals.append(number)
            if len(self.literals) > MAX_LITERALS:
                raise CountdownRejected(f"more than {MAX_LITERALS} numbers")
            return _bounded(Fraction(number))
        raise CountdownRejected(f"expected a number or '(' but got {token!r}")


def _tokenize(text: str) -> list[str]:
    tokens, pos = [], 0
    for match in _TOKEN.finditer(text):
        if text[pos : match.start()].strip(" "):
            raise CountdownRejected(f"unreadable text {text[pos : match.start()]!r}")
        tokens.append(match.group())
        pos = match.end()
    if text[pos:].strip(" "):
        raise CountdownRejected(f"unreadable text {text[pos:]!r}")
    return tokens


def _bounded(value: Fraction) -> Fraction:
    if abs(value.numerator) > MAX_ABS or value.denominator > MAX_ABS:
        raise CountdownRejected(f"intermediate value beyond {MAX_ABS}")
    return value


def _gold(row_nums: object, row_target: object) -> tuple[list[int], int] | None:
    """The row's numbers and target as integers, or None if the row does not hold integers."""
    try:
        numbers = [_as_int(n) for n in row_nums]
        return numbers, _as_int(row_target)
    except (TypeError, ValueError, OverflowError):
        return None


def _as_int(value: object) -> int:
    # Rows read back from JSON or Parquet may hold "23", 23.0 or a numpy integer; all are the integer 23.
    if isinstance(value, bool):
        raise TypeError("a boolean is not a countdown number")
    if isinstance(value, str):
        return int(value.strip())
    number = Fraction(value)
    if number.denominator != 1:
        raise ValueError(f"{value!r} is not an integer")
    return int(number)
