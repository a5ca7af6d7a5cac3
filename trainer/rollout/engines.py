"""Choosing a rollout engine from the recipe: transformers (any machine), vLLM or LMDeploy (the `[vllm]` and
`[lmdeploy]` extras, one environment each).

The GPU engines are imported only when a recipe asks for them, so everything else runs on a machine
without them. Asking for one that is not installed raises `trainer.extras.MissingExtraError`.
"""

from __future__ import annotations

from trainer.recipe import ENGINE_ALONE_UTILIZATION, ModelConfig, RolloutConfig
from trainer.rollout.base import RolloutEngine


def memory_utilization(cfg: RolloutConfig) -> float:
    """The engine's share of each of its GPUs. A recipe that leaves it unset (None) gets it from the memory
    plan: the trainer resolves a share beside its own ranks before it builds the engine
    (`trainer.memory_plan.engine_rollout`), so None here is an engine with its GPUs to itself."""
    u = cfg.gpu_memory_utilization
    return ENGINE_ALONE_UTILIZATION if u is None else u


def vllm_settings(cfg: RolloutConfig, max_model_len: int | None = None) -> dict:
    """The recipe's settings of an in-process vLLM engine (`VLLMEngine` keyword arguments)."""
    return dict(
        tensor_parallel_size=cfg.tensor_parallel_size,
        gpu_memory_utilization=memory_utilization(cfg),
        enable_sleep_mode=cfg.colocate,
        enforce_eager=cfg.enforce_eager,
        max_model_len=cfg.max_model_len or max_model_len,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
    )


def shares_weights(engine: RolloutEngine) -> bool:
    """True for the transformers engine: it generates with the module the weights live in, so it always
    samples them. vLLM and LMDeploy hold their own copy, which `load_policy` refreshes."""
    from trainer.multiturn.rollout import MultiTurnEngine
    from trainer.rollout.hf_engine import HFEngine

    if isinstance(engine, MultiTurnEngine):  # trajectories over an engine: that engine's weights
        engine = engine.inner
    return isinstance(engine, HFEngine)


def load_policy(engine: RolloutEngine, model, version: int) -> None:
    """Make `engine` sample policy `version`, the weights `model` holds now.

    An engine with its own copy gets every checkpoint tensor, tied ones under each name (`state_dict()`, not
    `named_parameters()`): vLLM keeps a separate copy of a tied `lm_head`, which a sync without
    `lm_head.weight` leaves on the old weights."""
    if shares_weights(engine):
        engine.version = version
    else:
        engine.update_weights(policy_tensors(model), version)


def policy_tensors(model):
    """(name, whole tensor) for every checkpoint tensor of `model`, also out of ZeRO-3 shards (collective
    there: every trainer rank iterates to the end, also those that send nothing); a LoRA policy's are its
    base model's with the adapters merged in (`trainer.lora`)."""
    from trainer.deepspeed_setup import gathered
    from trainer.lora import is_lora, merged, plain_state

    if is_lora(model):
        return merged(model, plain_state(model))
    return gathered(model.state_dict(keep_vars=True).items())


class ServedByRankZero:
    """What trainer ranks other than 0 hold in server mode. Rank 0 alone talks to the server: it sends the
    weights, generates each batch and hands it to the other ranks (`rollout.source.SyncRollout`), so this rank
    opens no connection and no weight-transfer communicator of its own. Asking it to generate or to send
    weights is a bug, and raises."""

    def __init__(self, server_url: str):
        self.server_url, self.version = server_url, 0

    def _refuse(self, *args, **kwargs):
        raise RuntimeError(f"only trainer rank 0 talks to the rollout server at {self.server_url}")

    generate = update_weights = sleep = wake_up = _refuse


def served_by_rank_zero(cfg: RolloutConfig) -> bool:
    """True when every trainer rank's batches come from one engine that rank 0 alone drives (a server)."""
    return cfg.engine == "vllm" and bool(cfg.server_url)


def _trainer_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def make_engine(
    cfg: RolloutConfig,
    model_path: str,
    *,
    model=None,
    tokenizer=None,
    device: str | None = None,
    model_cfg: ModelConfig | None = None,
    seed: int = 0,
    lmdeploy_backend: str = "pytorch",
    max_model_len: int | None = None,
) -> RolloutEngine:
    """The engine `cfg.engine` names, built for `model_path` with the recipe's `model_cfg` (its dtype, remote
    code and attention implementation; when None, the defaults with the checkpoint's own dtype, "auto").

    `device` None asks for this trainer rank's own engine, placed by `trainer.placement`: the recipe's engine
    on the rank's GPU (colocated, or synchronous without rollout devices; with several ranks vLLM runs under
    its external launcher, one engine per rank), on GPUs of its own (a lone trainer with rollout_devices), the
    transformers engine over the trainer's module when rollout is asynchronous (the recipe's engine runs in
    the rollout workers; this one serves the held-out evaluation), or in server mode the server's client on
    rank 0 and a `ServedByRankZero` stand-in on the other ranks. A rollout worker names its `device`.
    With `cfg.env` the engine is wrapped in a `trainer.multiturn.rollout.MultiTurnEngine`: it generates
    whole trajectories in that environment.

    transformers: wraps `model` and `tokenizer` when given (the trainer's own copy: generation then always
    sees the current weights), else loads both from `model_path` onto `device`.
    vllm: an in-process `vllm.LLM` with the recipe's engine settings (sleep mode on when `cfg.colocate` and
    the platform can sleep; `max_model_len` when the recipe sets none), or a client of the running server at
    `cfg.server_url`. lmdeploy: an in-process pipeline; `lmdeploy_backend` "pytorch" is the one whose
    weights can be updated in place.
    """
    engine = _make_engine(
        cfg,
        model_path,
        model=model,
        tokenizer=tokenizer,
        device=device,
        model_cfg=model_cfg,
        seed=seed,
        lmdeploy_backend=lmdeploy_backend,
        max_model_len=max_model_len,
    )
    if cfg.env is None:
        return engine
    from trainer.multiturn.rollout import in_environment

    if tokenizer is None:
        tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None:
        from trainer.model_loading import load_tokenizer

        tokenizer = load_tokenizer(model_path, model_cfg)
    return in_environment(engine, tokenizer, cfg.env)


def _make_engine(
    cfg: RolloutConfig,
    model_path: str,
    *,
    model,
    tokenizer,
    device: str | None,
    model_cfg: ModelConfig | None,
    seed: int,
    lmdeploy_backend: str,
    max_model_len: int | None,
) -> RolloutEngine:
    model_cfg = model_cfg or ModelConfig(dtype="auto")
    kind, executor = cfg.engine, None
    if device is None:
        from trainer.placement import this_trainer

        placement, me = this_trainer(cfg)
        if placement.mode == "workers":
            kind = "transformers"
        executor, device = placement.executor, me.engine_device or me.device
    if kind == "transformers":
        from trainer.rollout.hf_engine import HFEngine

        if model is None or tokenizer is None:
            from trainer.model_loading import load_model

            model, tokenizer = load_model(model_path, model_cfg, device)
            model.eval()
        return HFEngine(model, tokenizer)
    if kind == "vllm":
        if cfg.server_url:
            if _trainer_rank() != 0:
                return ServedByRankZero(cfg.server_url)
            from trainer.rollout.vllm_server import VLLMServerEngine

            return VLLMServerEngine(
                cfg.server_url,
                timeout_s=cfg.sync_timeout_s,
                weight_sync=cfg.weight_sync,
                weights_dir=cfg.weights_dir,
                sync_device=device if device.startswith("cuda") else "cuda:0",
            )
        from trainer.rollout.vllm_engine import VLLMEngine

        extra = {"distributed_executor_backend": executor} if executor else {}
        if model_cfg.trust_remote_code:  # False is vLLM's default: left out, its settings stay as they were
            extra["trust_remote_code"] = True
        return VLLMEngine(
            model_path, dtype=model_cfg.dtype, seed=seed, **vllm_settings(cfg, max_model_len), **extra
        )
    if kind == "lmdeploy":
        if cfg.server_url:
            raise ValueError(
                "rollout.server_url is supported for engine: vllm only; LMDeploy runs in-process here"
            )
        from trainer.rollout.lmdeploy_engine import LMDeployEngine

        return LMDeployEngine(
            model_path,
            backend=lmdeploy_backend,
            tensor_parallel_size=cfg.tensor_parallel_size,
            gpu_memory_utilization=memory_utilization(cfg),
            dtype=model_cfg.dtype,
            seed=seed,
        )
    raise ValueError(f"rollout.engine must be transformers, vllm or lmdeploy, got {cfg.engine!r}")
