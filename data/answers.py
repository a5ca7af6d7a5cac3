"""Reading the final answer out of a text: the one reader for gold solutions and model completions alike.

A gold answer (`data/adapters.py`: MATH's `solution`, a counting row's `<answer> 3 </answer>`) and a model's
answer (`trainer/rewards`, `evaluation/`) must be read by the same code, or a correct completion can be graded
against a differently-read key. `extract_answer` is that code; nothing else in the project takes an answer
out of `<answer>` tags or `\\boxed{}`.

The rule, in order:
1. The LAST well-formed `<answer>…</answer>` block: an opening tag, then text containing no `<answer>` or
   `</answer>`, then the closing tag. The last block wins because it is the model's final word; grading only
   one block means repeating the tag cannot buy extra guesses (and the `format` reward gives 0.0 to any
   completion with more than one). An unclosed block (a truncated completion) is no block. When the block's
   content holds a complete `\\boxed{…}`, the answer is that box's content (`<answer>\\boxed {12}</answer>` is
   12, as a bare `\\boxed {12}` is), so the grader never has to read box syntax.
2. No block at all: the content of the last `\\boxed{…}` or `\\fbox{…}` whose braces balance. Spaces between
   the command and its brace are allowed (`\\boxed {12}`, as LaTeX reads it); escaped braces `\\{ \\}` are
   content, not grouping; an unbalanced last box (a truncated completion) falls back to the last complete one.
3. Otherwise None.
The answer is stripped of surrounding whitespace (`\\boxed{ 12 }` is 12); an empty block is "" (an answer,
and a wrong one), not None.
"""

from __future__ import annotations

import re

# Tempered dot: the block's content may not contain another answer tag, so `<answer>a<answer>b</answer>`
# yields "b" (the innermost well-formed block), never "a<answer>b".
_ANSWER_BLOCK = re.compile(r"<answer>((?:(?!</?answer>).)*)</answer>", re.DOTALL)
# `\boxed` / `\fbox` as a whole command (not `\boxedfoo`), then optional spaces, then the opening brace.
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])[ \t]*\{")


def extract_answer(text: str) -> str | None:
    """The final answer of `text`: the last `<answer>` block (a box inside it unwrapped), else the last
    complete `\\boxed{}` / `\\fbox{}`, else None; stripped. The module docstring gives the whole rule."""
    last = None
    for match in _ANSWER_BLOCK.finditer(text):
        last = match
    if last is None:
        return _last_boxed(text)
    block = last.group(1)
    boxed = _last_boxed(block)
    return block.strip() if boxed is None else boxed


def _last_boxed(text: str) -> str | None:
    """Stripped content of the last `\\boxed{…}` / `\\fbox{…}` with balanced braces, or None."""
    for match in reversed(list(_BOX_OPEN.finditer(text))):
        content = _balanced_group(text, match.end())
        if content is not None:
            return content.strip()
        # Unbalanced (typically a truncated completion): an earlier, complete box is still an answer.
    return None


def _balanced_group(text: str, begin: int) -> str | None:
    """The text from `begin` up to the brace closing the one just before it, or None if it never closes."""
    depth, i = 1, begin
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # an escaped character, `\{` or `\}` included, does not open or close the group
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1
    return None
