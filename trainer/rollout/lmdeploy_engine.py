"""The LMDeploy rollout engine: an `lmdeploy.pipeline` in this process, generating from token ids.

LMDeploy is the `lmdeploy` extra (its own environment: its torch pin excludes the `vllm` extra's), imported
inside the constructor; without it the constructor raises `MissingExtraError` naming
`pip install '.[lmdeploy]'`. LMDeploy has no CPU backend, so nothing here has run in this project: the plain
functions below (`engine_config`, `generation_config`, `call_on_loop`) are unit-tested on CPU, and the names
they and the engine use are checked against LMDeploy's published source; the engine itself runs only in
`infra/gpu/smoke.sh`.

What was read (LMDeploy's source at the git tags v0.10.0 to v0.16.0, and the published 0.17.0 and 0.18.0
wheels):
- `GenerationConfig` supports n = 1 only, so each of a prompt's n samples is its own request with its own
  `random_seed`. Its defaults are greedy (`do_sample=False`) with top_k = 50, so both are set explicitly.
  The stop token is dropped from the output unless `include_stop_str_in_output` (0.11+), which is set so a
  completion ends with its EOS, as with the other engines.
- Token-id prompts: `AsyncEngine.generate(messages=None, session_id, gen_config, input_ids=...)` up to 0.15;
  from 0.16 `AsyncEngine.preprocess(..., input_ids=...)` then `generate(request)`. Both are driven here on
  the pipeline's own event loop.
- Behaviour log-probs differ by backend. PyTorch: only "raw" modes exist (`PytorchEngineConfig
  (logprobs_mode="raw_logprobs")`, 0.10+), i.e. log_softmax(logits) before temperature and top-k/top-p: the
  loss's log_softmax(logits / T) when T = 1 or greedy, and not obtainable otherwise, so for other
  temperatures they are reported as nan (the loss then gives those tokens importance weight 1, as for any
  unreported log-prob). TurboMind: taken after temperature and top-k/top-p filtering
  (src/turbomind/generation/sampling.cc), so exact when sampling with top_p = 1 and renormalised over the
  nucleus otherwise; greedy decoding filters to the top token first, so greedy log-probs are reported as nan.
- In-place weights: the PyTorch backend's `engine.update_params(UpdateParamsRequest(serialized_named_tensors=
  serialize_state_dict(...), finished=...))` loads CUDA-IPC-shared tensors through the model's own
  `load_weights` (same node, CUDA tensors). Only the Ray executor implements `update_params` (0.10 to 0.18):
  the single-process `UniExecutor`, which LMDeploy picks for tp = 1, and the `MPExecutor` inherit
  `ExecutorBase.update_params`, which raises NotImplementedError. So the PyTorch engine is always built with
  `distributed_executor_backend="ray"` (`engine_config`): the model then lives in a Ray worker process on a
  local Ray instance (`ray.init` by LMDeploy, its GPUs this process's CUDA_VISIBLE_DEVICES), and the
  IPC-shared tensors cross into it (the worker rebuilds them on its own current device). Ray puts the worker
  on a GPU this process sees: right for a rollout worker (it sees its engine's GPUs only) and a lone trainer;
  several trainer ranks that see the same GPUs, each with its own in-process LMDeploy engine, would not be
  placed rank by rank, and a colocated engine (a second process on the trainer's GPU) is not handled either:
  `trainer.placement` refuses both, naming rollout.engine. `update_params` blocks on the Ray workers;
  LMDeploy's own server calls it from a worker thread too (a plain `def` FastAPI endpoint), so it is called
  from this thread.
  TurboMind's `update_params` is a layer-by-layer loader for engines built with `empty_init=True` (0.10 to
  0.12) and is not wired up from 0.15, so `update_weights` raises NotImplementedError for backend="turbomind".
- `sleep(level)` / `wakeup(tags)` exist on the async engine from 0.10; `sleep` is a coroutine from 0.13,
  `wakeup` a plain method throughout. The PyTorch engine's `wakeup` (0.16+) unblocks requests and sets the
  engine loop's `asyncio.Event`s (`EngineLoop.resume_from_sleep`), which is only safe on the loop that owns
  them: the pipeline's `internal_thread.loop`, on which `Pipeline.__init__` starts the engine. Both are
  therefore run there (`call_on_loop`), as LMDeploy's server does from its `async def` endpoints.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import itertools
import logging
import math
from collections.abc import Iterable

import torch

from trainer.extras import import_extra
from trainer.rollout.base import Completion, SamplingParams
from trainer.rollout.weight_sync import buckets as weight_buckets

log = logging.getLogger("grpoflow.rollout.lmdeploy")
BACKENDS = ("pytorch", "turbomind")
BUCKET_BYTES = 512 << 20
# the only PyTorch-backend executor with update_params (LMDeploy 0.10 to 0.18)
WEIGHT_UPDATE_EXECUTOR = "ray"


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


def engine_config(
    config_cls,
    backend: str,
    *,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.8,
    dtype: str = "auto",
    session_len: int | None = None,
    version: str = "unknown",
    **engine_kwargs,
):
    """LMDeploy's backend config (`config_cls`: `PytorchEngineConfig` or `TurbomindEngineConfig`) for a
    rollout engine whose weights are updated in place.

    PyTorch backend: raw log-probs (`logprobs_mode="raw_logprobs"`) and the Ray executor, the only one with
    `update_params`. Raises RuntimeError for an LMDeploy without those fields (older than 0.11), ValueError
    when `engine_kwargs` asks for another executor.
    """
    fields = _field_names(config_cls)
    kwargs = {
        "tp": tensor_parallel_size,
        "dtype": dtype,
        "cache_max_entry_count": gpu_memory_utilization,
        **engine_kwargs,
    }
    if session_len is not None:
        kwargs["session_len"] = session_len
    if backend == "pytorch":
        for field in ("logprobs_mode", "distributed_executor_backend"):
            if field not in fields:
                raise RuntimeError(
                    f"LMDeploy {version}'s PyTorch engine has no {field}; grpoflow needs >= 0.11"
                )
        executor = kwargs.setdefault("distributed_executor_backend", WEIGHT_UPDATE_EXECUTOR)
        if executor != WEIGHT_UPDATE_EXECUTOR:
            raise ValueError(
                f"distributed_executor_backend={executor!r} cannot take the trainer's weights: only "
                f"LMDeploy's {WEIGHT_UPDATE_EXECUTOR!r} executor implements update_params (its 'uni' "
                "and 'mp' executors raise NotImplementedError)"
            )
        kwargs["logprobs_mode"] = "raw_logprobs"
    return config_cls(**kwargs)


def generation_config(config_cls, sampling: SamplingParams, seed: int | None):
    """LMDeploy's `GenerationConfig` (`config_cls`) for one sample of `sampling`, seeded with `seed`; the
    settings a release's class lacks are left out (its own default applies)."""
    greedy = sampling.temperature <= 0
    cfg = {
        "n": 1,
        "max_new_tokens": sampling.max_tokens,
        "do_sample": not greedy,
        "top_k": 0,
        "top_p": 1.0 if greedy else sampling.top_p,
        "temperature": 1.0 if greedy else sampling.temperature,
        "random_seed": seed,
        "logprobs": 1,
        "include_stop_str_in_output": True,
        "skip_special_tokens": True,
        "ignore_eos": sampling.ignore_eos,
    }
    fields = _field_names(config_cls)
    return config_cls(**{k: v for k, v in cfg.items() if k in fields})


def call_on_loop(loop: asyncio.AbstractEventLoop, fn, *args, timeout_s: float | None = None):
    """`fn(*args)` called on `loop` (running in another thread), awaited there if it returns an awaitable;
    waits for and returns the result. For LMDeploy methods that touch objects owned by its event loop."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        raise RuntimeError("call_on_loop would wait for its own event loop: call it from another thread")

    async def on_loop():
        result = fn(*args)
        return await result if inspect.isawaitable(result) else result

    return asyncio.run_coroutine_threadsafe(on_loop(), loop).result(timeout_s)


class LMDeployEngine:
    """Rollout engine over an in-process LMDeploy pipeline (backend "pytorch" or "turbomind").

    With the PyTorch backend the model runs in a Ray worker process that LMDeploy starts on this node (its Ray
    executor, the one that takes weight updates; `engine_kwargs` asking for another executor raise
    ValueError).
    `gpu_memory_utilization` becomes LMDeploy's `cache_max_entry_count`: the share of the GPU memory left
    after loading the weights that the KV cache takes (vLLM's setting counts the weights in). Raises
    `MissingExtraError` without LMDeploy, ValueError for a float32 dtype (LMDeploy runs float16/bfloat16),
    RuntimeError for an LMDeploy too old for token-id prompts with log-probs (older than 0.11).
    """

    def __init__(
        self,
        model_path: str,
        *,
        backend: str = "pytorch",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.8,
        dtype: str = "auto",
        seed: int = 0,
        session_len: int | None = None,
        timeout_s: float = 3600.0,
        **engine_kwargs,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"LMDeploy backend must be one of {BACKENDS}, got {backend!r}")
        if dtype not in ("auto", "float16", "bfloat16"):
            raise ValueError(f"LMDeploy runs dtype auto, float16 or bfloat16, got {dtype!r}")
        lmdeploy = import_extra("lmdeploy", "the 'lmdeploy' rollout engine")
        version = getattr(lmdeploy, "__version__", "unknown")
        config_cls = lmdeploy.PytorchEngineConfig if backend == "pytorch" else lmdeploy.TurbomindEngineConfig
        backend_config = engine_config(
            config_cls,
            backend,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype,
            session_len=session_len,
            version=version,
            **engine_kwargs,
        )
        if "include_stop_str_in_output" not in _field_names(lmdeploy.GenerationConfig):
            raise RuntimeError(f"LMDeploy {version} cannot return the stop token; grpoflow needs >= 0.11")
        self._gen_cls = lmdeploy.GenerationConfig
        self.pipe = lmdeploy.pipeline(model_path, backend_config=backend_config, log_level="ERROR")
        # 0.12+: the pipeline wraps an AsyncEngine; before, the pipeline was one
        self._async_engine = getattr(self.pipe, "async_engine", self.pipe)
        self.backend, self.seed, self.timeout_s = backend, seed, timeout_s
        self.lmdeploy_version = version
        self._session_ids = itertools.count(1)
        self._asleep: set[str] = set()
        self._weights_lost = False
        self.version = 0

    # -------------------------------------------------------------------------------------- plumbing
    def _run(self, coro):
        """Run a coroutine on the pipeline's event-loop thread (where its engine lives) and wait for it."""
        loop = self.pipe.internal_thread.loop
        return asyncio.run_coroutine_threadsafe(coro, loop).result(self.timeout_s)

    def _call(self, fn, *args):
        """`fn(*args)` on the pipeline's event loop, sync or coroutine alike (see `call_on_loop`)."""
        return call_on_loop(self.pipe.internal_thread.loop, fn, *args, timeout_s=self.timeout_s)

    def _gen_config(self, sampling: SamplingParams, seed: int | None):
        return generation_config(self._gen_cls, sampling, seed)

    def _exact_logprobs(self, sampling: SamplingParams) -> bool:
        greedy = sampling.temperature <= 0
        if self.backend == "pytorch":
            return greedy or sampling.temperature == 1.0
        return not greedy

    async def _one(self, ids: list[int], gen_config, limiter: asyncio.Semaphore):
        ae = self._async_engine
        async with limiter:
            session = ae.session_mgr.get() if hasattr(ae, "session_mgr") else next(self._session_ids)
            if hasattr(ae, "preprocess"):  # 0.16+
                request = await ae.preprocess(
                    messages=None, session_id=session, gen_config=gen_config, input_ids=list(ids)
                )
                stream = ae.generate(request, stream_response=False)
            else:
                stream = ae.generate(
                    messages=None,
                    session_id=session,
                    gen_config=gen_config,
                    input_ids=list(ids),
                    stream_response=False,
                )
            tokens, logprobs, text, reason = [], [], "", None
            async for out in stream:  # each output carries the tokens (and log-probs) since the previous one
                tokens += list(out.token_ids or [])
                logprobs += list(out.logprobs or [])
                text += out.response or ""
                reason = out.finish_reason or reason
            return tokens, logprobs, text, reason

    async def _all(self, requests: list[tuple[list[int], object]]):
        size = getattr(getattr(self._async_engine, "backend_config", None), "max_batch_size", None) or 64
        limiter = asyncio.Semaphore(size)
        return await asyncio.gather(*[self._one(ids, cfg, limiter) for ids, cfg in requests])

    # ------------------------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        if self._asleep:
            raise RuntimeError(
                f"the LMDeploy engine is asleep ({sorted(self._asleep)}); call wake_up() first"
            )
        if self._weights_lost:
            raise RuntimeError(
                "sleep(level=2) discarded the weights; call update_weights() before generating"
            )
        greedy = sampling.temperature <= 0
        per_prompt = 1 if greedy else n
        requests = []
        # seeded per prompt by its index in the whole batch: a share of it samples what the batch would
        for p, ids in enumerate(prompts, start=sampling.first_prompt):
            for j in range(per_prompt):
                seed = None if sampling.seed is None else sampling.seed + p * per_prompt + j
                requests.append((ids, self._gen_config(sampling, seed)))
        outputs = self._run(self._all(requests))
        exact = self._exact_logprobs(sampling)
        completions = [self._completion(*o, exact=exact) for o in outputs]
        groups = [completions[p * per_prompt : (p + 1) * per_prompt] for p in range(len(prompts))]
        if greedy:
            groups = [
                [
                    dataclasses.replace(g[0], token_ids=list(g[0].token_ids), logprobs=list(g[0].logprobs))
                    for _ in range(n)
                ]
                for g in groups
            ]
        return groups

    def _completion(self, tokens, logprobs, text, reason, *, exact: bool) -> Completion:
        if reason not in ("stop", "length"):
            raise RuntimeError(f"LMDeploy finished a request with reason {reason!r}")
        if exact:
            if len(logprobs) != len(tokens):
                raise RuntimeError(f"LMDeploy returned {len(logprobs)} log-probs for {len(tokens)} tokens")
            values = [float(pos[tok]) for pos, tok in zip(logprobs, tokens, strict=True)]
        else:
            values = [math.nan] * len(tokens)
        return Completion(tokens, values, reason, self.version, text)

    # --------------------------------------------------------------------------------------- weights
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if self.backend != "pytorch":
            raise NotImplementedError(
                "LMDeploy's TurboMind backend has no in-place weight update usable between generations "
                "(update_params only fills engines built with empty_init=True, layer by layer, up to 0.12, "
                "and is not wired up from 0.15); use backend='pytorch' for training"
            )
        if "weights" in self._asleep:
            raise RuntimeError("the weights are asleep; call wake_up(['weights']) before update_weights()")
        from lmdeploy.serve.openai.protocol import UpdateParamsRequest
        from lmdeploy.utils import serialize_state_dict

        engine = self._async_engine.engine
        buckets = list(weight_buckets([(name, t.detach()) for name, t in named_tensors], BUCKET_BYTES))
        for i, bucket in enumerate(buckets):
            for name, t in bucket:
                if not t.is_cuda:
                    raise ValueError(f"LMDeploy loads weights through CUDA IPC; {name} is on {t.device}")
            payload = serialize_state_dict(dict(bucket))
            engine.update_params(
                UpdateParamsRequest(serialized_named_tensors=payload, finished=i == len(buckets) - 1)
            )
        torch.cuda.synchronize()
        self._weights_lost = False
        self.version = version

    # ---------------------------------------------------------------------------------------- memory
    def sleep(self, level: int = 1) -> None:
        self._call(self._async_engine.sleep, level)
        self._asleep = {"weights", "kv_cache"}
        self._weights_lost = level >= 2

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call(self._async_engine.wakeup, tags)
        self._asleep = set() if tags is None else self._asleep - set(tags)
