"""Thinking-efficiency metrics of reasoning models: how long they think, how often they switch thoughts, and
how much of their thinking comes after they already had the right answer.

Per sample (`sample_metrics`), from the assistant message and the gold answers:

- reasoning: the message's `reasoning_content` (or EvalScope's `{"type": "reasoning"}` content block) when
  present; else the text before the LAST `</think>`; else the whole output. It is stripped, and a leading
  `<think>` tag is dropped (markup, not thought), so `<think>R</think>T` gives the same reasoning whether
  EvalScope separated it or not.
- `reasoning_tokens`: the reasoning's length in the model's own tokenizer (no special tokens added).
- `thought_num`: occurrences, case-insensitive, of ThinkBench's switch phrases (`SWITCH_PHRASES`) in the
  reasoning.
- `correct` (-> `accuracy`): the whole output graded by `trainer.rewards.grade_math_answer`, the `accuracy`
  reward's verifier: its last `<answer>` block, else its last `\\boxed{}`, compared under math-verify; correct
  if it matches any gold answer. None when no gold answer parses (the dataset's fault); such samples are left
  out of `accuracy`.
- paragraphs: the reasoning split at blank lines (a line break, then only whitespace and at least one more
  line break). Prefix k is the reasoning up to the end of paragraph k, as written (separators kept).
- `first_correct_paragraph`: the first k whose prefix is correct by the same verifier (the prefix's last
  `<answer>` block, else its last `\\boxed{}`), or by the optional `judge(prefix, gold) -> bool` (e.g.
  `OpenAIJudge`, for free-form reasoning without boxed answers). None if no prefix is. Computed for every
  sample, so a wrong sample whose reasoning once held the right answer is visible.
- `first_correct_tokens`, `reflection_tokens` (= `reasoning_tokens - first_correct_tokens`) and
  `token_efficiency` (= `first_correct_tokens / reasoning_tokens`) are defined only for correct samples, None
  for the others. A correct sample whose reasoning never states the answer (it comes after `</think>`) found
  it at the end of its reasoning: `first_correct_tokens = reasoning_tokens`. `token_efficiency` is None for an
  empty reasoning (0/0).

Aggregates (`summarize`; per subset, per benchmark, overall): `reasoning_tokens` and `thought_num` are means
over all samples; `first_correct_tokens`, `reflection_tokens`, `token_efficiency` means over correct samples
(the efficiency over those with reasoning); `accuracy` the share of graded samples that are correct.
`overthinking` covers the correct samples that had the answer before their reasoning ended
(`reflection_tokens > 0`): their mean reflection tokens and mean share of reasoning spent after the first
correct answer. `underthinking` covers wrong samples: their mean `thought_num`, and how many had the right
answer in their reasoning and left it (`abandoned_correct`). Counts `samples`, `graded`, `correct` come along,
and `evalscope_accuracy`, the mean of EvalScope's own per-sample verdicts (work dirs only), so a disagreement
between the two verifiers shows. A mean over no samples is None.

Differences from EvalScope's ThinkBench (`evalscope/third_party/thinkbench/eval.py`), on purpose:
- ThinkBench's first-correct text is the paragraphs BEFORE the one its judge names, dropping the paragraph
  that holds the answer; here the prefix includes it.
- ThinkBench treats an answer in the first paragraph as no correct answer at all (empty prefix -> score 0);
  here it counts as correct at paragraph 1.
- ThinkBench scores a sample whose reasoning never reached the answer as 0 first-correct tokens, all its
  tokens as reflection and efficiency 0, and averages those over all samples; here they are undefined for
  wrong samples and averaged over correct ones, so efficiency and accuracy do not mix.
- ThinkBench's `accuracy` is "the judge found a correct paragraph"; here it is the final output's verdict by
  the same verifier as the training reward, and prefixes are graded by that verifier unless a judge is given.
- ThinkBench's keyword split is case-sensitive; here nothing is split at keywords (counting is
  case-insensitive in both). ThinkBench also keeps only the first 50 samples per subset under 8000 tokens;
  here all are measured.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from data.errors import MissingPathError
from data.manifest import write_jsonl_atomic
from data.progress import progress_enabled
from evaluation.thinking_inputs import Sample, default_out, read_samples
from trainer.rewards import extract_answer, grade_math_answer

SWITCH_PHRASES = (
    "alternatively",
    "but wait",
    "let me reconsider",
    "another way",
    "another approach",
    "another method",
    "another angle",
)  # ThinkBench's list
THINK_END = "</think>"
_THINK_START = re.compile(r"\s*<think>")
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")

Judge = Callable[[str, str], bool]
CountTokens = Callable[[str], int]


def split_reasoning(message: Mapping) -> tuple[str, str, str]:
    """(reasoning, whole output, where the reasoning came from: "reasoning_content" | "think_tag" |
    "whole_output").

    With separate reasoning the whole output is the reasoning, a blank line, then the text.
    """
    content = message.get("content")
    blocks = [b for b in content if isinstance(b, Mapping)] if isinstance(content, list) else []
    text = (
        content
        if isinstance(content, str)
        else "".join(b.get("text") or "" for b in blocks if b.get("type") == "text")
    )
    separate = (
        message.get("reasoning_content")
        or message.get("reasoning")
        or "\n\n".join(b.get("reasoning") or "" for b in blocks if b.get("type") == "reasoning")
    )
    if isinstance(separate, str) and separate.strip():
        return _clean(separate), f"{separate}\n\n{text}", "reasoning_content"
    end = text.rfind(THINK_END)
    if end != -1:
        return _clean(text[:end]), text, "think_tag"
    return _clean(text), text, "whole_output"


def _clean(reasoning: str) -> str:
    opening = _THINK_START.match(reasoning)
    return reasoning[opening.end() if opening else 0 :].strip()


def count_thought_switches(reasoning: str) -> int:
    """Case-insensitive occurrences of `SWITCH_PHRASES` (none of them contains another, so none counts
    twice)."""
    lowered = reasoning.lower()
    return sum(lowered.count(phrase) for phrase in SWITCH_PHRASES)


def paragraph_prefixes(reasoning: str) -> list[str]:
    """Prefix k = the reasoning up to the end of its k-th paragraph; paragraphs end at blank lines."""
    if not reasoning.strip():
        return []
    ends = [m.start() for m in _PARAGRAPH_BREAK.finditer(reasoning)] + [len(reasoning)]
    return [reasoning[:end] for end in ends if reasoning[:end].strip()]


def token_counter(tokenizer: object) -> CountTokens:
    """A `count_tokens(text) -> int` from a tokenizer with `encode(text) -> list`, or from such a function
    itself.

    A transformers tokenizer counts without the special tokens (BOS) it would add to a whole prompt.
    """
    encode = getattr(tokenizer, "encode", None)
    if encode is None:
        if callable(tokenizer):
            return tokenizer
        raise TypeError(
            f"tokenizer must have encode(text) or be count_tokens(text), got {type(tokenizer).__name__}"
        )
    transformers = sys.modules.get("transformers")  # only a loaded transformers can have made this tokenizer
    if transformers is not None and isinstance(tokenizer, transformers.PreTrainedTokenizerBase):
        return lambda text: len(encode(text, add_special_tokens=False))
    return lambda text: len(encode(text))


def load_tokenizer(name_or_path: str) -> CountTokens:
    """The token counter of a transformers tokenizer (a checkpoint directory or a hub id)."""
    from transformers import AutoTokenizer

    try:
        return token_counter(AutoTokenizer.from_pretrained(name_or_path))
    except OSError as e:  # transformers' "can't load tokenizer": a bad path or an unreachable hub id
        raise MissingPathError(f"tokenizer {name_or_path!r} could not be loaded: {e}") from None


def grade(text: str, golds: Sequence[str]) -> bool | None:
    """True if the final answer of `text` matches any gold answer; None if no gold answer parses."""
    verdicts = [grade_math_answer(text, gold) for gold in golds]
    if any(v == 1.0 for v in verdicts):
        return True
    return None if all(v is None for v in verdicts) else False


def first_correct_paragraph(
    prefixes: Sequence[str], golds: Sequence[str], judge: Judge | None = None
) -> int | None:
    """The 1-based index of the first correct prefix, by the verifier or by `judge`; None if none is."""
    verdicts: dict[str, bool] = {}  # final answer -> verdict: most prefixes repeat the previous one's answer
    for k, prefix in enumerate(prefixes, 1):
        if judge is not None:
            correct = any(judge(prefix, gold) for gold in golds)
        else:
            answer = extract_answer(prefix)
            if answer is None:
                continue
            if answer not in verdicts:
                verdicts[answer] = grade(prefix, golds) is True
            correct = verdicts[answer]
        if correct:
            return k
    return None


def sample_metrics(
    message: Mapping | str, golds: Sequence[str] | str, count_tokens: CountTokens, judge: Judge | None = None
) -> dict:
    """The per-sample metrics (see the module docstring) of one assistant message, or of a whole output
    text."""
    if isinstance(message, str):
        message = {"content": message}
    golds = [golds] if isinstance(golds, str) else list(golds)
    reasoning, output, source = split_reasoning(message)
    prefixes = paragraph_prefixes(reasoning)
    correct = grade(output, golds)
    first = first_correct_paragraph(prefixes, golds, judge)
    tokens = count_tokens(reasoning)
    row = {
        "reasoning_source": source,
        "paragraphs": len(prefixes),
        "reasoning_tokens": tokens,
        "thought_num": count_thought_switches(reasoning),
        "correct": correct,
        "first_correct_paragraph": first,
        "first_correct_tokens": None,
        "reflection_tokens": None,
        "token_efficiency": None,
    }
    if correct:
        # min(): a subword tokenizer may, rarely, spend one token more on a prefix than on the whole text
        useful = tokens if first is None else min(count_tokens(prefixes[first - 1]), tokens)
        row.update(
            first_correct_tokens=useful,
            reflection_tokens=tokens - useful,
            token_efficiency=useful / tokens if tokens else None,
        )
    return row


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def summarize(rows: Sequence[Mapping]) -> dict:
    """Means of the per-sample metrics over `rows` (see the module docstring for which samples each
    covers)."""
    graded = [r for r in rows if r["correct"] is not None]
    right = [r for r in rows if r["correct"]]
    wrong = [r for r in rows if r["correct"] is False]
    early = [r for r in right if r["reflection_tokens"] > 0]
    scored = [r["evalscope_score"] for r in rows if r.get("evalscope_score") is not None]
    return {
        "samples": len(rows),
        "graded": len(graded),
        "correct": len(right),
        "accuracy": len(right) / len(graded) if graded else None,
        "reasoning_tokens": _mean(r["reasoning_tokens"] for r in rows),
        "thought_num": _mean(r["thought_num"] for r in rows),
        "first_correct_tokens": _mean(r["first_correct_tokens"] for r in right),
        "reflection_tokens": _mean(r["reflection_tokens"] for r in right),
        "token_efficiency": _mean(r["token_efficiency"] for r in right if r["token_efficiency"] is not None),
        "overthinking": {
            "samples": len(early),
            "reflection_tokens": _mean(r["reflection_tokens"] for r in early),
            "reflection_fraction": _mean(r["reflection_tokens"] / r["reasoning_tokens"] for r in early),
        },
        "underthinking": {
            "samples": len(wrong),
            "thought_num": _mean(r["thought_num"] for r in wrong),
            "abandoned_correct": sum(r["first_correct_paragraph"] is not None for r in wrong),
        },
        "evalscope_accuracy": _mean(scored),
    }


@dataclass
class ThinkingReport:
    """The metrics of every sample of one input, and their aggregates."""

    rows: list[dict]  # per sample: benchmark, subset, id, gold, evalscope_score, then `sample_metrics`
    summary: dict  # `summarize` over all rows, plus per_benchmark (each with its subsets) and samples_path
    samples_path: Path  # where the rows were written, one JSON object per line


def analyze(
    path: str | os.PathLike,
    tokenizer: object,
    *,
    out: str | os.PathLike | None = None,
    judge: Judge | None = None,
    progress: bool | None = None,
) -> ThinkingReport:
    """Measure every sample of an EvalScope work dir or a JSONL (see `thinking_inputs`) and write the rows to
    `out` (default `thinking_inputs.default_out`). `tokenizer`: a name or path for `load_tokenizer`, or
    anything `token_counter` accepts."""
    samples = read_samples(path)  # before the tokenizer loads: bad input fails fast
    count_tokens = (
        load_tokenizer(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else token_counter(tokenizer)
    )
    rows = [_row(s, count_tokens, judge) for s in _progress(samples, progress)]
    samples_path = Path(out) if out is not None else default_out(path)
    write_jsonl_atomic(samples_path, rows)
    summary = summarize(rows)
    summary["per_benchmark"] = {}
    for bench in dict.fromkeys(r["benchmark"] for r in rows):
        of_bench = [r for r in rows if r["benchmark"] == bench]
        subsets = {
            s: summarize([r for r in of_bench if r["subset"] == s])
            for s in dict.fromkeys(r["subset"] for r in of_bench)
        }
        summary["per_benchmark"][bench] = {**summarize(of_bench), "subsets": subsets}
    summary["samples_path"] = str(samples_path)
    return ThinkingReport(rows, summary, samples_path)


def _row(sample: Sample, count_tokens: CountTokens, judge: Judge | None) -> dict:
    return {
        "benchmark": sample.benchmark,
        "subset": sample.subset,
        "id": sample.id,
        **({"problem_id": sample.problem} if sample.problem is not None else {}),
        "gold": sample.golds,
        "evalscope_score": sample.evalscope_score,
        **sample_metrics(sample.message, sample.golds, count_tokens, judge),
    }


def _progress(samples: list[Sample], enabled: bool | None):
    if not progress_enabled(enabled):
        return samples
    from tqdm import tqdm

    return tqdm(samples, desc="thinking metrics", unit="sample")


def format_table(summary: Mapping) -> str:
    """A plain-text table: one line per benchmark and subset, then the overall line. Columns: accuracy, then
    the means of reasoning tokens, thought switches, first-correct tokens, reflection tokens and token
    efficiency."""
    columns = {
        "samples": "samples",
        "accuracy": "accuracy",
        "reasoning_tokens": "reasoning",
        "thought_num": "switches",
        "first_correct_tokens": "to_correct",
        "reflection_tokens": "reflection",
        "token_efficiency": "efficiency",
    }
    lines = [f"{'':<20}" + "".join(f"{header:>12}" for header in columns.values())]

    def line(name: str, s: Mapping) -> str:
        cells = (
            "-" if s[c] is None else f"{s[c]:.3f}" if isinstance(s[c], float) else str(s[c]) for c in columns
        )
        return f"{name[:20]:<20}" + "".join(f"{cell:>12}" for cell in cells)

    for bench, s in summary["per_benchmark"].items():
        lines.append(line(bench, s))
        if len(s["subsets"]) > 1:
            lines += [line(f"  {subset}", sub) for subset, sub in s["subsets"].items()]
    lines.append(line("overall", summary))
    over, under = summary["overthinking"], summary["underthinking"]
    if over["samples"]:
        lines.append(
            f"overthinking: {over['samples']} correct samples had the answer before their reasoning ended; "
            f"{over['reflection_fraction']:.1%} of it ({over['reflection_tokens']:.1f} tokens) came after"
        )
    if under["samples"]:
        lines.append(
            f"underthinking: {under['samples']} wrong samples switched thoughts {under['thought_num']:.2f} "
            f"times on average; {under['abandoned_correct']} had the right answer and left it"
        )
    return "\n".join(lines)


class OpenAIJudge:
    """A `judge(prefix, gold) -> bool` asking a chat model at an OpenAI-compatible endpoint whether the
    reasoning so far has reached the gold answer. Greedy, a few tokens; the reply must start with YES."""

    PROMPT = (
        "Here is the beginning of a solution to a problem, and the problem's correct final answer.\n\n"
        "<solution>\n{prefix}\n</solution>\n\nCorrect final answer: {gold}\n\n"
        "Has the solution so far stated this final answer as its result? Reply YES or NO only."
    )

    def __init__(self, base_url: str, model: str, *, api_key_env: str | None = None, timeout_s: float = 60.0):
        from openai import OpenAI

        api_key = os.environ.get(api_key_env, "") if api_key_env else "EMPTY"  # local servers take any key
        if not api_key:
            raise ValueError(f"judge api_key_env={api_key_env!r}: the environment variable is not set")
        self.model = model
        self._client = OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=2)

    def __call__(self, prefix: str, gold: str) -> bool:
        reply = self._client.chat.completions.create(
            model=self.model,
            temperature=0.0,
            max_tokens=4,
            messages=[{"role": "user", "content": self.PROMPT.format(prefix=prefix, gold=gold)}],
        )
        return (reply.choices[0].message.content or "").strip().upper().startswith("YES")
