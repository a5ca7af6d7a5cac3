"""Task adapters: one raw record of a known dataset in, the question, gold answer and task columns out.

An adapter is a function `(raw, base_dir) -> Example`. It checks the fields it needs and raises `FieldError`
(which field, what was expected, what it got) when one is missing, empty or unparseable; `data.prepare` adds
the location and turns the `Example` into a prepared row with `data.schema.make_row`.

- gsm8k: `question`; answer = the number after the last `####` of `answer`, commas dropped ("1,000" ->
  "1000").
- math (MATH, MATH-500, AIME): `problem`; answer = `answer` (read like a model answer when it carries
  `<answer>` tags or a \\boxed{}), else the final answer of `solution`; columns `subject`, `level`,
  `unique_id` when present.
- numina (NuminaMath-TIR): `problem`; answer = the final answer of `solution`; `messages` is ignored.
- countdown: `nums` + `target`, or `input` ("30,100,93") + `output` ("23"); answer = str(target);
  columns `nums`, `target`.
- counting (CLEVR-style, R1-V / CLEVR-70k-Counting layout): `images`/`image`/`image_path` (one image or a
  list: paths relative to the source file, file:// or http(s):// URLs, bytes or base64; each must decode, see
  `data.images`), `problem`/`question` (default COUNTING_QUESTION), `count`/`answer`/`solution` (3, "3" or
  "<answer> 3 </answer>", read like a model answer: the last block counts); column `images` (one reference per
  image), and `videos` / `audios` as given.
- A gold answer in `<answer>` tags or a \\boxed{} is read by `data.answers.extract_answer`, the reader the
  rewards use for the model's answer, so both sides read `\\boxed {12}` and repeated tags alike.
- synthetic: `question`, `answer`, columns `nums`, `target`, `solution` when present; `split` is honoured.
- Any task: a record's `tools` (the tool schemas its prompt offers, OpenAI / Qwen function format) is checked
  (`data.schema.check_tools`) and kept as the `tools` column; the chat template shows them to the model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from data.answers import extract_answer
from data.errors import DataError, FieldError
from data.images import image_refs


@dataclass(frozen=True)
class Example:
    question: str
    answer: str
    columns: dict = field(default_factory=dict)
    source_id: str | None = None  # the record's own id, used for the prepared id when present
    split: str | None = None  # "train" or "heldout" when the source assigns the split itself


Adapter = Callable[[Mapping, "Path | None"], Example]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
COUNTDOWN_PROMPT = (
    "Using the numbers {nums}, create an equation that equals {target}. "
    "You can use basic arithmetic operations "
    "(+, -, *, /) and each number exactly once. Show your work in <think> </think> tags and return the final "
    "equation in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
)
COUNTING_QUESTION = "How many items are there in the image?"


def _text(raw: Mapping, *names: str, expected: str = "non-empty text") -> str:
    """The first of `names` present in `raw`, as stripped non-empty text."""
    for name in names:
        if raw.get(name) is not None:
            value = raw[name]
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise FieldError(name, expected, type(value).__name__)
            text = str(value).strip()
            if not text:
                raise FieldError(name, expected, value, reason=f"empty field '{name}'")
            return text
    raise FieldError("/".join(names), expected, reason=f"missing field '{names[0]}'")


def _optional(raw: Mapping, *names: str) -> dict:
    return {n: raw[n] for n in names if raw.get(n) is not None and raw[n] != ""}


def gsm8k(raw: Mapping, base_dir: Path | None = None) -> Example:
    expected = "a worked solution ending in '#### <number>'"
    question = _text(raw, "question")
    solution = _text(raw, "answer", expected=expected)
    if "####" not in solution:
        raise FieldError("answer", expected, solution[-80:], reason="no '#### <number>' in 'answer'")
    final = solution.rsplit("####", 1)[1].strip().replace(",", "")  # "1,000" -> "1000"
    if not final:
        raise FieldError("answer", expected, solution[-80:], reason="empty field 'answer'")
    if not _NUMBER.fullmatch(final):
        raise FieldError("answer", expected, final)
    return Example(question, final)


def math(raw: Mapping, base_dir: Path | None = None) -> Example:
    question = _text(raw, "problem", "question")
    answer = str(raw["answer"]).strip() if raw.get("answer") is not None else ""
    answer = _read(answer)
    if not answer:
        if raw.get("solution") is None:
            empty = "empty" if "answer" in raw else "missing"
            raise FieldError(
                "answer",
                "a non-empty 'answer', or a 'solution' with \\boxed{...}",
                raw.get("answer"),
                reason=f"{empty} field 'answer'",
            )
        answer = _boxed_answer(raw)
    columns = _optional(raw, "subject", "level", "unique_id")
    source_id = raw.get("unique_id") if raw.get("unique_id") is not None else raw.get("id")
    return Example(question, answer, columns, None if source_id is None else str(source_id))


def numina(raw: Mapping, base_dir: Path | None = None) -> Example:
    return Example(_text(raw, "problem"), _boxed_answer(raw))


def _boxed_answer(raw: Mapping) -> str:
    solution = _text(raw, "solution", expected="a solution with a \\boxed{...} answer")
    answer = extract_answer(solution)
    if answer is None:
        raise FieldError(
            "solution",
            "a solution with a \\boxed{...} answer",
            solution[-80:],
            reason="no \\boxed{} answer in 'solution'",
        )
    if not answer:
        raise FieldError(
            "solution", "a non-empty \\boxed{...} answer", solution[-80:], reason="empty field 'answer'"
        )
    return answer


def _read(text: str) -> str:
    """A gold answer's text as the rewards read a model's: the answer inside tags or a box, else as given."""
    answer = extract_answer(text)
    return text if answer is None else answer


def countdown(raw: Mapping, base_dir: Path | None = None) -> Example:
    if raw.get("nums") is not None or raw.get("target") is not None:
        nums_field, target_field = "nums", "target"
    elif raw.get("input") is not None or raw.get("output") is not None:
        nums_field, target_field = "input", "output"
    else:
        raise FieldError("nums", "'nums' and 'target', or 'input' (\"30,100,93\") and 'output' (\"23\")")
    nums = _int_list(raw.get(nums_field), nums_field)
    target = _int(raw.get(target_field), target_field, "an integer target")
    question = COUNTDOWN_PROMPT.format(nums=nums, target=target)
    return Example(question, str(target), {"nums": nums, "target": target})


def _int(value: object, name: str, expected: str) -> int:
    if value is None:
        raise FieldError(name, expected)
    if isinstance(value, bool):
        raise FieldError(name, expected, value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    text = str(value).strip()
    if not text:
        raise FieldError(name, expected, value, reason=f"empty field '{name}'")
    if not re.fullmatch(r"-?\d+", text):
        raise FieldError(name, expected, value)
    return int(text)


def _int_list(value: object, name: str) -> list[int]:
    expected = 'a list of integers, or text like "30,100,93"'
    if isinstance(value, str):
        value = [v for v in value.strip().strip("[]").split(",") if v.strip()]
    if not isinstance(value, (list, tuple)) or not value:
        raise FieldError(name, expected, value, reason=f"empty field '{name}'" if value in ([], ()) else None)
    return [_int(v, name, expected) for v in value]


def counting(raw: Mapping, base_dir: Path | None = None) -> Example:
    images = _images(raw, base_dir)
    question = next(
        (str(raw[n]).strip() for n in ("problem", "question") if str(raw.get(n) or "").strip()),
        COUNTING_QUESTION,
    )
    name = next((n for n in ("count", "answer", "solution") if raw.get(n) is not None), None)
    expected = 'a non-negative integer count (3, "3" or "<answer> 3 </answer>")'
    if name is None:
        raise FieldError("count", expected, reason="missing field 'count'")
    value = raw[name]
    if isinstance(value, str):
        value = _read(value)
    count = _int(value, name, expected)
    if count < 0:
        raise FieldError(name, expected, count)
    split = raw.get("split")  # the synthetic counting pools name their split
    if split is not None and split not in ("train", "heldout"):
        raise FieldError("split", "'train' or 'heldout'", split)
    # videos / audios are kept as given: a model whose processor takes them gets them, any other refuses
    # the row
    return Example(
        question, str(count), {"images": images, **_optional(raw, "videos", "audios")}, split=split
    )


def _images(raw: Mapping, base_dir: Path | None) -> list[str]:
    name = next((n for n in ("images", "image", "image_path") if raw.get(n) is not None), None)
    if name is None:
        raise FieldError(
            "image", "an image: a path, URL, bytes or base64 text", reason="missing field 'image'"
        )
    return image_refs(raw[name], name, base_dir)


def synthetic(raw: Mapping, base_dir: Path | None = None) -> Example:
    # Addition rows name their pool in `split`: the evaluation pool must stay out of training at every stage.
    split = raw.get("split")
    if split is not None and split not in ("train", "heldout"):
        raise FieldError("split", "'train' or 'heldout'", split)
    return Example(
        _text(raw, "question"),
        _text(raw, "answer"),
        _optional(raw, "nums", "target", "solution"),
        split=split,
    )


ADAPTERS: dict[str, Adapter] = {
    "gsm8k": gsm8k,
    "math": math,
    "numina": numina,
    "countdown": countdown,
    "counting": counting,
    "synthetic": synthetic,
}


def get_adapter(name: str) -> Adapter:
    try:
        return ADAPTERS[name]
    except KeyError:
        raise DataError(f"unknown task '{name}'; valid tasks: {', '.join(sorted(ADAPTERS))}") from None
