"""The rollout engine interface: what the trainer asks of whatever generates completions.

An engine takes tokenized prompts and returns, per prompt, `n` sampled completions with the token ids
and the behaviour policy's log-probability of each sampled token, computed under the same temperature
the loss uses (log_softmax(logits / T)). The transformers engine lives in `hf_engine.py`; vLLM and
LMDeploy adapters are imported only when a recipe asks for them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = (
        False  # decode max_tokens tokens whatever is sampled (benchmarks and load tests, as in vLLM)
    )
    # (first prompt, prompts in the whole batch) when a call generates one share of a larger batch (each
    # trainer rank its own): the engine samples these prompts exactly as it would inside the whole batch
    share: tuple[int, int] | None = None

    @property
    def first_prompt(self) -> int:
        """The index in the whole batch of this call's first prompt."""
        return self.share[0] if self.share is not None else 0


def contiguous_shares(n: int, parts: int) -> list[tuple[int, int]]:
    """`n` items cut into `parts` consecutive (start, end) slices whose sizes differ by at most one, the
    larger first."""
    base, extra = divmod(n, parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # behaviour log-probs of token_ids under log_softmax(logits / temperature)
    finish_reason: str  # "stop" (EOS) or "length" (hit max_tokens)
    policy_version: int = 0
    text: str = field(default="", repr=False)  # a multi-turn trajectory's: its final model turn's
    # a multi-turn trajectory (`trainer.multiturn`): 1 on the tokens the model wrote, 0 on the observations
    # between its turns (which the loss never sees); None: every token is the model's
    token_mask: list[int] | None = field(default=None, repr=False)
    trajectory: dict | None = field(default=None, repr=False)  # turns, tool calls, errors, cut, messages


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        """`n` completions for each prompt (token ids, no padding), in prompt order."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new policy weights; completions generated afterwards carry `version`."""

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory while the trainer uses the devices (colocated mode)."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo `sleep`; `tags` (e.g. ["weights"], then ["kv_cache"]) wake parts in order."""
