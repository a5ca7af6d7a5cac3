"""From sampled completions to the tensors the loss needs: one scored rollout batch, cut into padded
micro-batches.

Sequences are [left-padded prompt | right-padded completion]; position ids count real tokens only, so the
trainer's forward sees the same positions the engine saw while sampling.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from trainer.rollout.base import Completion
from trainer.vision import VisionInputs, vision_of


@dataclass(frozen=True)
class MicroBatch:
    """The padded tensors of some completions of a batch: what one forward and backward takes."""

    input_ids: torch.Tensor  # [b, P + C] left-padded prompt | right-padded completion
    attention_mask: torch.Tensor  # [b, P + C]
    position_ids: torch.Tensor  # [b, P + C] counting real tokens only
    completion_mask: torch.Tensor  # [b, C] float: 1 on the model-written completion tokens in the loss
    behaviour_logps: torch.Tensor  # [b, C] the sampling engine's log-probs of those tokens (0 on padding)
    advantages: torch.Tensor  # [b]
    prompt_width: int  # P
    prompt_rows: torch.Tensor  # the first row of each distinct prompt (rows of a GRPO group share one)
    prompt_inverse: torch.Tensor  # [b] each row's distinct prompt, an index into prompt_rows
    # k when the rows are whole runs of k rows per distinct prompt, in prompt order (prompt_inverse is
    # 0 x k, 1 x k, ...: GRPO groups kept whole); None otherwise
    prompt_repeats: int | None = None
    vision: VisionInputs | None = None  # the images of these rows' prompts, in row order (None: text only)

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_width :]

    def to(self, device: str | torch.device) -> MicroBatch:
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), (torch.Tensor, VisionInputs))
            },
        )


@dataclass
class RolloutBatch:
    prompt_ids: list[list[int]]  # one per completion (prompts repeated for their group)
    completions: list[Completion]
    advantages: torch.Tensor  # [B]
    loss_mask: torch.Tensor  # [B] 1 where the completion takes part in the loss
    policy_version: int = 0
    sampled_out: int = (
        0  # completions of groups that dynamic sampling dropped: not in the batch, as DAPO has it
    )
    rewards: torch.Tensor | None = None  # [B] each completion's total reward (NaN where one is missing)

    def __len__(self) -> int:
        return len(self.completions)

    def num_tokens(self) -> int:
        """Prompt and completion tokens of the whole batch (each prompt counted once per completion)."""
        return sum(len(p) + len(c.token_ids) for p, c in zip(self.prompt_ids, self.completions, strict=True))

    def micro_batch(self, index: torch.Tensor, pad_id: int) -> MicroBatch:
        """Padded tensors for the completions at `index`, trimmed to this micro-batch's longest rows.

        An empty `index` gives a stand-in: the batch's first row with none of its tokens in the loss, for a
        trainer rank that has run out of rows while the others still run collective backward passes."""
        if len(index) == 0:
            stand_in = self.micro_batch(torch.zeros(1, dtype=torch.long), pad_id)
            return dataclasses.replace(stand_in, completion_mask=torch.zeros_like(stand_in.completion_mask))
        rows = index.tolist()
        prompts, completions = [self.prompt_ids[i] for i in rows], [self.completions[i] for i in rows]
        p_len = max(len(p) for p in prompts)
        c_len = max(max(len(c.token_ids) for c in completions), 1)
        # the rows as lists, made tensors at once (a tensor per row and field took 1-2 ms a step)
        ids_rows, attn_rows, behaviour_rows, lengths = [], [], [], []
        for p, c in zip(prompts, completions, strict=True):
            n = len(c.token_ids)
            lengths.append(n)
            ids_rows.append([pad_id] * (p_len - len(p)) + [*p, *c.token_ids] + [pad_id] * (c_len - n))
            attn_rows.append([0] * (p_len - len(p)) + [1] * (len(p) + n) + [0] * (c_len - n))
            behaviour_rows.append([*c.logprobs] + [0.0] * (c_len - n))
        ids, attn = torch.tensor(ids_rows, dtype=torch.long), torch.tensor(attn_rows, dtype=torch.long)
        behaviour = torch.tensor(behaviour_rows, dtype=torch.float32)
        written = torch.arange(c_len) < torch.tensor(lengths)[:, None]
        cmask = written.float() * self.loss_mask[index].float()[:, None]
        for r, (p, c, n) in enumerate(zip(prompts, completions, lengths, strict=True)):
            if n and c.token_mask is not None:  # observations between a trajectory's turns: not the model's
                cmask[r, :n] *= torch.tensor(c.token_mask, dtype=cmask.dtype)
            if n and (vision := vision_of(p)) is not None and vision.image_token_id in c.token_ids:
                # A sampled image placeholder has no image behind it: fed back it would make the model look
                # for one more image than it was given. Such a completion is left out of the loss, and the
                # placeholder is padding in the forward (its tokens' log-probs are then never used).
                ids[r, p_len : p_len + n].masked_fill_(
                    ids[r, p_len : p_len + n] == vision.image_token_id, pad_id
                )
                cmask[r] = 0.0
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        # rows that share a prompt (a GRPO group): the prompt's forward can be computed once for all of them
        unique_of: dict[tuple, int] = {}
        unique_rows, inverse = [], []  # first row of each distinct prompt; each row's distinct prompt
        for r, p in enumerate(prompts):
            key = (tuple(p), id(vision_of(p)))  # same tokens, other image: other prompt
            if key not in unique_of:
                unique_of[key] = len(unique_rows)
                unique_rows.append(r)
            inverse.append(unique_of[key])
        k = len(rows) // len(unique_rows)
        runs = inverse == [g for g in range(len(unique_rows)) for _ in range(k)]
        return MicroBatch(
            input_ids=ids,
            attention_mask=attn,
            position_ids=positions,
            completion_mask=cmask,
            behaviour_logps=behaviour,
            advantages=self.advantages[index],
            prompt_width=p_len,
            prompt_rows=torch.tensor(unique_rows),
            prompt_inverse=torch.tensor(inverse),
            prompt_repeats=k if runs else None,
            vision=VisionInputs.concat([vision_of(p) for p in prompts]),
        )
