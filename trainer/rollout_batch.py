"""From sampled completions to the tensors the loss needs: one scored, padded rollout batch.

Sequences are [left-padded prompt | right-padded completion]; position ids count real tokens only, so the
trainer's forward sees the same positions the engine saw while sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.rollout.base import Completion


@dataclass
class RolloutBatch:
    prompt_ids: list[list[int]]  # one per completion (prompts repeated for their group)
    completions: list[Completion]
    advantages: torch.Tensor  # [B]
    loss_mask: torch.Tensor  # [B] 1 where the completion takes part in the loss
    policy_version: int = 0

    def __len__(self) -> int:
        return len(self.completions)

    def micro_batch(self, index: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
        """Padded tensors for the completions at `index`, trimmed to this micro-batch's longest rows."""
        rows = index.tolist()
        p_len = max(len(self.prompt_ids[i]) for i in rows)
        c_len = max(max(len(self.completions[i].token_ids) for i in rows), 1)
        ids = torch.full((len(rows), p_len + c_len), pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        cmask = torch.zeros((len(rows), c_len))
        behaviour = torch.zeros((len(rows), c_len))
        for r, i in enumerate(rows):
            p, c = self.prompt_ids[i], self.completions[i]
            ids[r, p_len - len(p):p_len] = torch.tensor(p)
            attn[r, p_len - len(p):p_len] = 1
            n = len(c.token_ids)
            if n:
                ids[r, p_len:p_len + n] = torch.tensor(c.token_ids)
                attn[r, p_len:p_len + n] = 1
                cmask[r, :n] = float(self.loss_mask[i])
                behaviour[r, :n] = torch.tensor(c.logprobs)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        # rows that share a prompt (a GRPO group): the prompt's forward can be computed once for all of them
        unique_of: dict[tuple, int] = {}
        unique_rows, inverse = [], []  # first row of each distinct prompt; each row's distinct prompt
        for r, i in enumerate(rows):
            key = tuple(self.prompt_ids[i])
            if key not in unique_of:
                unique_of[key] = len(unique_rows)
                unique_rows.append(r)
            inverse.append(unique_of[key])
        return {"prompt_rows": torch.tensor(unique_rows), "prompt_inverse": torch.tensor(inverse),
                "input_ids": ids, "attention_mask": attn, "position_ids": positions, "completion_mask": cmask,
                "behaviour_logps": behaviour, "advantages": self.advantages[index], "prompt_width": p_len,
                "completion_ids": ids[:, p_len:]}
