"""The trainer's log-probabilities of completion tokens (trainer/logprobs.py): one prompt forward per distinct
prompt, its keys and values handed to the prompt's rows, against one forward of every whole sequence."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer.logprobs import completion_logps
from trainer.rollout.base import Completion
from trainer.rollout.batch import RolloutBatch


def _batch(prompt_lengths: list[int], group: int, completion_lengths: list[int]) -> RolloutBatch:
    """GRPO groups: `group` completions per prompt, in prompt order; token ids from a fixed generator."""
    g = torch.Generator().manual_seed(0)
    prompts, completions = [], []
    for p_len in prompt_lengths:
        prompt = torch.randint(10, 300, (p_len,), generator=g).tolist()
        for _ in range(group):
            n = completion_lengths[len(completions) % len(completion_lengths)]
            ids = torch.randint(10, 300, (n,), generator=g).tolist()
            prompts.append(prompt)
            completions.append(Completion(ids, [0.0] * n, "stop", 0, ""))
    rows = len(completions)
    advantages = torch.linspace(-1.0, 1.0, rows)
    return RolloutBatch(prompts, completions, advantages, torch.ones(rows))


def test_rows_in_whole_runs_per_prompt_are_marked_with_their_run_length():
    batch = _batch([5, 7, 6], group=4, completion_lengths=[3, 2])
    assert batch.micro_batch(torch.arange(12), 0).prompt_repeats == 4
    assert batch.micro_batch(torch.arange(4, 12), 0).prompt_repeats == 4  # whole groups, from the second
    assert batch.micro_batch(torch.arange(10), 0).prompt_repeats is None  # the last group cut
    assert batch.micro_batch(torch.tensor([0, 4, 1, 5]), 0).prompt_repeats is None  # interleaved
    assert batch.micro_batch(torch.tensor([0, 1, 2, 3, 5, 6]), 0).prompt_repeats is None  # 4 then 2
    assert batch.micro_batch(torch.tensor([3]), 0).prompt_repeats == 1


@pytest.mark.parametrize("group", [2, 3, 4, 8])
def test_shared_prompt_logps_are_the_full_forwards_and_both_row_maps_agree_to_the_bit(tiny_base, group):
    """Rows in whole runs per prompt take their prompt's keys and values by an expand (backward: a sum over
    the run), others by index_select (backward: index_add_): the same log-probs and the same gradients to
    the last bit; both match one forward of the whole sequences within float rounding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_base["path"]).train()
    batch = _batch([9, 14, 11], group=group, completion_lengths=[6, 4, 5])
    mb = batch.micro_batch(torch.arange(len(batch)), 0)
    assert mb.prompt_repeats == group

    def logps_and_grads(micro, share):
        model.zero_grad(set_to_none=True)
        logps, _ = completion_logps(model, micro, 0.7, share_prompts=share)
        (logps * micro.completion_mask * micro.advantages[:, None]).sum().backward()
        return logps.detach(), [p.grad.clone() for p in model.parameters()]

    expanded, expanded_grads = logps_and_grads(mb, True)
    indexed, indexed_grads = logps_and_grads(dataclasses.replace(mb, prompt_repeats=None), True)
    full, full_grads = logps_and_grads(mb, False)
    assert torch.equal(expanded, indexed)
    assert all(torch.equal(a, b) for a, b in zip(expanded_grads, indexed_grads, strict=True))
    mask = mb.completion_mask > 0
    assert torch.allclose(expanded[mask], full[mask], atol=1e-5)
    # each gradient within 1e-4 of its largest entry (2e-5 at most measured): float sums in another order
    worst = max((a - b).abs().max() / b.abs().max() for a, b in zip(expanded_grads, full_grads, strict=True))
    assert worst < 1e-4, worst
