"""Stopping a diverging run before anything of the bad step is saved.

A non-finite loss or gradient norm stops the run before the optimizer update is applied; non-finite weights,
or weights whose forward overflows, right after it. Either way `NonFiniteError` names the step and the values;
under DDP all ranks stop together.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.rollout.batch import MicroBatch


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss, gradient norm or weights; nothing of that step is saved."""


def stop_unless_finite(
    values: dict[str, torch.Tensor], when: str, *, step: int, output_dir: Path, world: int
) -> None:
    """NonFiniteError naming `step` and those of `values` that are not finite (all ranks agree under DDP)."""
    flags = torch.stack([torch.isfinite(v.detach()).all() for v in values.values()]).to(torch.int32)
    if world > 1:
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)
    if bool(flags.all()):
        return
    bad = [
        f"{name} {v.item():g}" for (name, v), ok in zip(values.items(), flags.tolist(), strict=True) if not ok
    ]
    raise NonFiniteError(
        f"step {step}: non-finite {' and '.join(bad)} {when}; training stopped "
        f"before anything of this step was saved to {output_dir}. Lower "
        "train.learning_rate, or check the rewards and the data"
    )


@torch.no_grad()
def updated_policy_extremes(model, probe: MicroBatch | None) -> dict[str, torch.Tensor]:
    """The largest |weight| of `model`, and the largest |logit| it gives on two sequences of `probe`: huge but
    finite weights can overflow in the forward, and the next rollout would fail on them. The probe forward
    runs in eval mode and draws no random numbers."""
    largest = torch.stack([p.abs().amax() for p in model.parameters()]).amax()  # NaN propagates
    logit = torch.zeros((), device=largest.device)
    if probe is not None:
        device, was_training = model.device, model.training
        model.eval()
        logits = model(
            input_ids=probe.input_ids[:2].to(device),
            attention_mask=probe.attention_mask[:2].to(device),
            position_ids=probe.position_ids[:2].to(device),
            use_cache=False,
        ).logits
        model.train(was_training)
        logit = logits.float().abs().amax().to(largest.device)
    return {"largest |weight|": largest, "largest |logit|": logit}


__all__ = ["NonFiniteError", "stop_unless_finite", "updated_policy_extremes"]
