"""Reading the final answer out of a text: the one reader for gold solutions and model completions alike.

A gold answer (`data/adapters.py`, MATH's `solution`) and a model's answer (`trainer/rewards`, evaluation)
must be read by the same code, or a correct completion can be graded against a differently-read key.

- `extract_answer` returns the content of the LAST well-formed `<answer>…</answer>` block: an opening tag, then
  text containing no `<answer>` or `</answer>`, then the closing tag. The last block wins because it is the model's
  final word; grading only one block means repeating the tag cannot buy extra guesses (and the `format` reward
  gives 0.0 to any completion with more than one). An unclosed block (a truncated completion) is no answer.
- `last_boxed` returns the content of the last `\\boxed{…}` or `\\fbox{…}` whose braces balance. Spaces between
  the command and its brace are allowed (`\\boxed {12}`, as LaTeX reads it); escaped braces `\\{ \\}` are content,
  not grouping; an unbalanced last box (a truncated completion) falls back to the last complete one.
- `final_answer` is `extract_answer`, falling back to `last_boxed` only when there is no answer block at all.
"""

from __future__ import annotations

import re

# Tempered dot: the block's content may not contain another answer tag, so `<answer>a<answer>b</answer>`
# yields "b" (the innermost well-formed block), never "a<answer>b".
_ANSWER_BLOCK = re.compile(r"<answer>((?:(?!</?answer>).)*)</answer>", re.DOTALL)
# `\boxed` / `\fbox` as a whole command (not `\boxedfoo`), then optional spaces, then the opening brace.
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])[ \t]*\{")


def extract_answer(text: str) -> str | None:
    """Stripped content of the last well-formed `<answer>…</answer>` block, or None if there is none."""
    last = None
    for match in _ANSWER_BLOCK.finditer(text):
        last = match
    return None if last is None else last.group(1).strip()


def last_boxed(text: str) -> str | None:
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


def final_answer(text: str) -> str | None:
    """The answer to grade: the last `<answer>` block, else the last `\\boxed{}`, else None."""
    answer = extract_answer(text)
    return answer if answer is not None else last_boxed(text)
