"""fp32 master weights for a policy that computes in a lower precision (bf16), for the strategies that step a
torch optimizer themselves (single process, DDP); DeepSpeed's ZeRO optimizer keeps its own.

AdamW applied to bf16 parameters rounds every update below half a bf16 ulp of the weight away (at |w| ~ 0.02
that is ~6e-5: most updates at learning rates like 1e-5). So the optimizer owns fp32 copies: the forward and
backward run in the module's dtype, the gradients are widened onto the copies, the copies are clipped and
stepped, and the module gets the stepped copies rounded back. A float32 module has no copies: the optimizer
steps its own parameters.
"""

from __future__ import annotations

import torch

from trainer.lora import trainable_parameters


class MasterWeights:
    """The parameters an optimizer steps for `model`: fp32 copies when any parameter is in a lower precision,
    else the module's own."""

    def __init__(self, model: torch.nn.Module):
        self.module_params = trainable_parameters(model)  # a LoRA policy's adapters alone
        low = any(p.is_floating_point() and p.dtype != torch.float32 for p in self.module_params)
        self.masters = (
            [
                torch.nn.Parameter(p.detach().float().clone(), requires_grad=p.requires_grad)
                for p in self.module_params
            ]
            if low
            else None
        )

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """What the optimizer updates and the gradient norm is taken over."""
        return self.module_params if self.masters is None else self.masters

    def gradients_to_masters(self) -> None:
        """Widen the module's accumulated gradients onto the fp32 copies (and free the low-precision ones)."""
        if self.masters is None:
            return
        for p, m in zip(self.module_params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    def masters_to_module(self) -> None:
        """Round the stepped fp32 copies into the module the next forward runs."""
        if self.masters is None:
            return
        with torch.no_grad():
            for p, m in zip(self.module_params, self.masters, strict=True):
                p.copy_(m)

    def state_dict(self) -> dict:
        """The fp32 copies (checkpointed: the module's rounded weights alone would lose their low bits)."""
        return {} if self.masters is None else {"master_weights": [m.detach().clone() for m in self.masters]}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("master_weights")
        if self.masters is None or saved is None:  # a float32 run: nothing to restore
            return
        with torch.no_grad():
            for m, s in zip(self.masters, saved, strict=True):
                m.copy_(s)
        self.masters_to_module()


__all__ = ["MasterWeights"]
