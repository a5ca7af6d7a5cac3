"""Choosing a rollout engine from the recipe: transformers (any machine), vLLM or LMDeploy (the `[gpu]` extra).

The GPU engines are imported only when a recipe asks for them, so everything else runs on a machine
without them. Asking for one that is not installed raises `trainer.extras.MissingExtraError`.
"""

from __future__ import annotations

from trainer.recipe import RolloutConfig
from trainer.rollout.base import RolloutEngine


def make_engine(cfg: RolloutConfig, model_path: str, *, model=None, tokenizer=None, device: str = "cpu",
                dtype: str = "auto", seed: int = 0, lmdeploy_backend: str = "pytorch") -> RolloutEngine:
    """The engine `cfg.engine` names, built for `model_path`.

    transformers: wraps `model` and `tokenizer` when given (the trainer's own copy: generation then always
    sees the current weights), else loads both from `model_path` onto `device`.
    vllm: an in-process `vllm.LLM` (sleep mode on when `cfg.colocate`), or a client of the running server
    at `cfg.server_url`. lmdeploy: an in-process pipeline; `lmdeploy_backend` "pytorch" is the one whose
    weights can be updated in place.
    """
    if cfg.engine == "transformers":
        from trainer.rollout.hf_engine import HFEngine

        if model is None or tokenizer is None:
            from trainer.model_loading import load_model
            from trainer.recipe import ModelConfig

            model, tokenizer = load_model(model_path, ModelConfig(dtype=dtype), device)
            model.eval()
        return HFEngine(model, tokenizer)
    if cfg.engine == "vllm":
        if cfg.server_url:
            from trainer.rollout.vllm_engine import VLLMServerEngine

            return VLLMServerEngine(cfg.server_url, timeout_s=cfg.sync_timeout_s)
        from trainer.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, tensor_parallel_size=cfg.tensor_parallel_size,
                          gpu_memory_utilization=cfg.gpu_memory_utilization, enable_sleep_mode=cfg.colocate,
                          dtype=dtype, seed=seed)
    if cfg.engine == "lmdeploy":
        if cfg.server_url:
            raise ValueError("rollout.server_url is supported for engine: vllm only; LMDeploy runs in-process here")
        from trainer.rollout.lmdeploy_engine import LMDeployEngine

        return LMDeployEngine(model_path, backend=lmdeploy_backend, tensor_parallel_size=cfg.tensor_parallel_size,
                              gpu_memory_utilization=cfg.gpu_memory_utilization, dtype=dtype, seed=seed)
    raise ValueError(f"rollout.engine must be transformers, vllm or lmdeploy, got {cfg.engine!r}")
