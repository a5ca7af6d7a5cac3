"""DeepSpeed ZeRO for the trainer ranks: the config in one place, and the engine built around our optimizer.

DeepSpeed is the `[gpu]` extra; it is imported inside `initialize`, so this module imports anywhere. The
optimizer is torch's AdamW handed to DeepSpeed (with `zero_allow_untested_optimizer`), so nothing has to be
compiled: DeepSpeed's fused Adam builds a CUDA extension on first use. Stage 2 shards optimizer state and
gradients; stage 3 also shards parameters (then weight sync must gather them, see `rollout/weight_sync.py`).
"""

from __future__ import annotations

import os

import torch

from trainer.extras import import_extra


def zero_config(stage: int = 2, micro_batch_size: int = 1, grad_accum: int = 1, max_grad_norm: float = 1.0,
                bf16: bool = True) -> dict:
    """A DeepSpeed config dict for ZeRO `stage` (1, 2 or 3) with bf16 compute and fp32 master weights."""
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": max_grad_norm if max_grad_norm > 0 else 0.0,
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


def initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: dict):
    """The DeepSpeed engine for `model`; a single process without torchrun gets a world of one."""
    deepspeed = import_extra("deepspeed", "DeepSpeed ZeRO training")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        from trainer.rollout.remote import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine
