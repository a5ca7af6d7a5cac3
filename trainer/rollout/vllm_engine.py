"""vLLM rollout engines: `VLLMEngine` (a `vllm.LLM` in this process) and `VLLMServerEngine` (a running server).

Both implement the `RolloutEngine` protocol of `base.py`. vLLM is the `[gpu]` extra: it is imported inside
the constructor, and a missing install raises `MissingExtraError` naming `pip install '.[gpu]'`.

Behaviour log-probs. The loss wants log_softmax(logits / T) of each sampled token. vLLM's V1 sampler returns,
by default, log-probs of the *raw* logits (before temperature, penalties and top-k/top-p; "raw_logprobs").
From vLLM 0.10.2 the engine argument `logprobs_mode="processed_logprobs"` returns them after temperature
and top-k/top-p instead (vLLM 0.10.0 knew only the raw modes), which is what TRL's colocate and server modes
use too; `VLLMEngine` sets it and refuses a vLLM that does not accept it. Two consequences, both also true of
TRL: with top_p < 1 the values are renormalised over the nucleus, i.e. log_softmax(logits / T) minus the log
of the nucleus' probability mass, so they differ from the trainer's full-softmax log-probs (exact when
top_p = 1, the usual GRPO setting); for greedy requests (T = 0) vLLM skips temperature and returns
log_softmax(logits), which is what `HFEngine` reports for greedy decoding.

Read (not run here; nothing in this module has run on a GPU in this project): vLLM's `LLM` API reference
(generate, sleep(level), wake_up(tags), collective_rpc, apply_model, reset_prefix_cache), the V1 sampler
documentation (0.10.0, 0.10.2, 0.19 to 0.22), vLLM's weight-transfer and sleep-mode guides, and TRL 1.16's
`trl/generation/vllm_generation.py`, `vllm_client.py` and `scripts/vllm_serve.py`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable

import torch

from trainer.extras import MissingExtraError, import_extra
from trainer.rollout.base import Completion, SamplingParams

log = logging.getLogger("grpoflow.rollout.vllm")
FINISH_REASONS = ("stop", "length")


def _load_weights(model, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside each vLLM worker (via `LLM.apply_model`): the model's own loader maps HF names
    (stacked qkv / gate-up projections, tied embeddings) and shards for tensor parallelism."""
    model.load_weights(weights)
    return len(weights)


def _repeat(c: Completion, n: int) -> list[Completion]:
    """`n` independent copies of one (greedy) completion."""
    return [Completion(list(c.token_ids), list(c.logprobs), c.finish_reason, c.policy_version, c.text)
            for _ in range(n)]


def _attr_path(obj, path: str):
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


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
    model's loader without a copy through the host. With `in_process=False`, or tensor parallelism, the
    weights travel to the workers pickled; they are moved to CPU first, and VLLM_ALLOW_INSECURE_SERIALIZATION
    is set (unless already set) because vLLM only ships a function to its workers with it. For large models
    on separate devices prefer vLLM's NCCL weight-transfer engine (see `VLLMServerEngine`).

    Sleep levels (vLLM's): 1 offloads weights to host memory and drops the KV cache; 2 drops both, so after
    `wake_up(["weights"])` the weights must be sent again with `update_weights` before generating, which
    this class enforces. `sleep` is a no-op when the engine was built without `enable_sleep_mode`.

    Raises `MissingExtraError` without vLLM, and RuntimeError for a vLLM without
    logprobs_mode="processed_logprobs" (older than 0.10.2) or with no known in-place weight-loading path.
    """

    def __init__(self, model_path: str, *, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.9,
                 enable_sleep_mode: bool = False, dtype: str = "auto", seed: int = 0, in_process: bool = True,
                 enforce_eager: bool = False, max_model_len: int | None = None, **llm_kwargs):
        vllm = import_extra("vllm", "the 'vllm' rollout engine")
        if in_process:  # vLLM reads its environment when the engine is built, so after the import is early enough
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self._vllm_sampling_params = vllm.SamplingParams
        self.vllm_version = getattr(vllm, "__version__", "unknown")
        kwargs = dict(model=model_path, tensor_parallel_size=tensor_parallel_size,
                      gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode,
                      dtype=dtype, seed=seed, enforce_eager=enforce_eager, logprobs_mode="processed_logprobs",
                      **llm_kwargs)
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        try:
            self.llm = vllm.LLM(**kwargs)
        except (TypeError, ValueError) as e:
            if "logprobs_mode" in str(e) or "processed_logprobs" in str(e):
                raise RuntimeError(
                    f"vLLM {self.vllm_version} does not accept logprobs_mode='processed_logprobs', without which "
                    "its log-probs ignore the sampling temperature; grpoflow needs vLLM >= 0.10.2") from e
            raise
        self.sleep_enabled = enable_sleep_mode
        self._ships_weights = not in_process or tensor_parallel_size > 1
        self._asleep: set[str] = set()
        self._weights_lost = False
        self._warned_top_p = False
        self.version = 0

    # ---------------------------------------------------------------------------------------- generation
    def _params(self, sampling: SamplingParams, n: int, prompt_index: int):
        greedy = sampling.temperature <= 0
        seed = None if sampling.seed is None else sampling.seed + prompt_index * n  # vLLM seeds sample j: seed + j
        return self._vllm_sampling_params(n=n, temperature=0.0 if greedy else sampling.temperature,
                                          top_p=1.0 if greedy else sampling.top_p, max_tokens=sampling.max_tokens,
                                          seed=seed, logprobs=0)

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        if self._asleep:
            raise RuntimeError(f"the vLLM engine is asleep ({sorted(self._asleep)}); call wake_up() first")
        if self._weights_lost:
            raise RuntimeError("sleep(level=2) discarded the vLLM weights; call update_weights() before generating")
        if sampling.top_p < 1.0 and not self._warned_top_p:
            log.warning("top_p=%s: vLLM's behaviour log-probs are renormalised over the nucleus and differ from "
                        "the trainer's full-softmax log-probs", sampling.top_p)
            self._warned_top_p = True
        greedy = sampling.temperature <= 0
        per_prompt = 1 if greedy else n  # greedy samples are all the same: generate one, repeat it
        params = [self._params(sampling, per_prompt, p) for p in range(len(prompts))]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        groups = []
        for out in outputs:
            group = [self._completion(o) for o in sorted(out.outputs, key=lambda o: o.index)]
            groups.append(_repeat(group[0], n) if greedy else group)
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
        if "weights" in self._asleep:
            raise RuntimeError("the vLLM weights are asleep; call wake_up(['weights']) before update_weights()")
        weights = [(name, t.detach()) for name, t in named_tensors]
        if self._ships_weights:
            weights = [(name, t.cpu()) for name, t in weights]
        if hasattr(self.llm, "apply_model"):  # newer vLLM: runs on every worker, in or out of process
            self.llm.apply_model(functools.partial(_load_weights, weights=weights))
        else:  # older vLLM: the model object itself, reachable in process only (what TRL and ms-swift used)
            model = _attr_path(self.llm, "llm_engine.model_executor.driver_worker.model_runner.model")
            if model is None:
                raise RuntimeError(f"vLLM {self.vllm_version} offers neither LLM.apply_model nor "
                                   "llm_engine.model_executor.driver_worker.model_runner.model: no known way "
                                   "to load weights in place")
            model.load_weights(weights)
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


class VLLMServerError(RuntimeError):
    """The vLLM server could not be reached or answered with an error; the message names the request."""


class VLLMServerEngine:
    """Rollout engine over an already-running vLLM OpenAI-compatible server (separate devices).

    Assumes the server was started the way TRL >= 1.x expects:
    `VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --logprobs-mode processed_logprobs
    --weight-transfer-config '{"backend": "nccl"}'` (what `trl vllm-serve` now runs). Generation goes
    through `/v1/completions` with token-id prompts (`return_token_ids`, `return_tokens_as_token_ids`,
    `logprobs: 0`) and needs nothing but the standard library. When the server exposes `/server_info`
    (dev mode) its logprobs_mode is checked at start; without it, that is taken on trust.

    Weight sync delegates to TRL's `VLLMClient` (NCCL group with the server's workers, then
    `/start_weight_update`, `/update_weights`, `/finish_weight_update`, `/reset_prefix_cache`): it needs
    `trl` and vLLM installed on the trainer side and the tensors on a CUDA device (`sync_device`). The old
    `trl vllm-serve` server (its own /generate/ endpoint, no /v1/completions) is not supported.
    `sleep` / `wake_up` call the server's dev-mode `/sleep` and `/wake_up` endpoints.
    """

    def __init__(self, server_url: str, *, timeout_s: float = 600.0, model: str | None = None,
                 sync_device: str = "cuda:0", group_port: int = 51216):
        self.url = server_url.rstrip("/")
        self.timeout_s = timeout_s
        self.sync_device, self.group_port = sync_device, group_port
        self._request("GET", "/health", raw=True)
        self.model = model or self._request("GET", "/v1/models")["data"][0]["id"]
        self._check_logprobs_mode()
        self._client = None
        self.version = 0

    def _request(self, method: str, path: str, payload: dict | None = None, params: dict | None = None,
                 raw: bool = False):
        url = self.url + path + (f"?{urllib.parse.urlencode(params, doseq=True)}" if params else "")
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            raise VLLMServerError(f"{method} {url} answered HTTP {e.code}: {e.read()[:500]!r}") from e
        except (urllib.error.URLError, TimeoutError) as e:
            raise VLLMServerError(f"cannot reach the vLLM server at {self.url} ({method} {path}): {e}") from e
        return body if raw else (json.loads(body) if body else None)

    def _check_logprobs_mode(self) -> None:
        try:
            info = self._request("GET", "/server_info", params={"config_format": "json"})
        except VLLMServerError:
            log.warning("%s has no /server_info (not in dev mode): assuming it runs with "
                        "--logprobs-mode processed_logprobs", self.url)
            return
        mode = _find_key(info, "logprobs_mode")
        if mode is not None and mode != "processed_logprobs":
            raise ValueError(f"the vLLM server at {self.url} runs with logprobs_mode={mode!r}; its log-probs "
                             "ignore the sampling temperature. Restart it with --logprobs-mode processed_logprobs")

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        greedy = sampling.temperature <= 0
        per_prompt = 1 if greedy else n
        payload = {"model": self.model, "prompt": [list(p) for p in prompts], "n": per_prompt,
                   "temperature": 0.0 if greedy else sampling.temperature,
                   "top_p": 1.0 if greedy else sampling.top_p, "max_tokens": sampling.max_tokens, "logprobs": 0,
                   "return_token_ids": True, "return_tokens_as_token_ids": True}
        if sampling.seed is not None:
            payload["seed"] = sampling.seed
        body = self._request("POST", "/v1/completions", payload)
        groups = completions_from_response(body, len(prompts), per_prompt, self.version)
        return [_repeat(g[0], n) for g in groups] if greedy else groups

    def _weight_client(self):
        if self._client is None:
            try:
                from trl.generation.vllm_client import VLLMClient
            except ImportError:
                try:
                    from trl.extras.vllm_client import VLLMClient
                except ImportError as e:
                    raise MissingExtraError("weight sync to a vLLM server uses TRL's VLLMClient and vLLM's NCCL "
                                            "helpers on the trainer side: pip install '.[gpu]' trl") from e
            self._client = VLLMClient(base_url=self.url, group_port=self.group_port,
                                      connection_timeout=self.timeout_s)
            self._client.init_communicator(device=self.sync_device)
        return self._client

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        client = self._weight_client()
        named = [(name, t.detach().to(self.sync_device)) for name, t in named_tensors]
        if hasattr(client, "update_named_params"):  # TRL >= 1.x: one announced, streamed update
            meta = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in named]
            client.update_named_params(meta, iter(named))
        else:
            for name, t in named:
                client.update_named_param(name, t)
        client.reset_prefix_cache()
        self.version = version

    def sleep(self, level: int = 1) -> None:
        self._request("POST", "/sleep", params={"level": level}, raw=True)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._request("POST", "/wake_up", params={"tags": tags} if tags else None, raw=True)


def completions_from_response(body: dict, n_prompts: int, n: int, version: int = 0) -> list[list[Completion]]:
    """Groups of `n` Completions from an OpenAI `/v1/completions` body (choices prompt-major by `index`).

    Token ids come from `token_ids` (vLLM's `return_token_ids`) or else from the `token_id:<id>` strings that
    `return_tokens_as_token_ids` puts in `logprobs.tokens`; log-probs from `logprobs.token_logprobs`.
    """
    choices = sorted(body["choices"], key=lambda c: c["index"])
    if len(choices) != n_prompts * n:
        raise VLLMServerError(f"expected {n_prompts * n} choices ({n_prompts} prompts x {n}), got {len(choices)}")
    out = []
    for c in choices:
        lp = c.get("logprobs") or {}
        ids = c.get("token_ids")
        if ids is None:
            ids = [int(str(t).removeprefix("token_id:")) for t in lp.get("tokens", [])]
        logps = lp.get("token_logprobs")
        if logps is None or len(logps) != len(ids):
            raise VLLMServerError(f"choice {c['index']}: {len(ids)} tokens but logprobs {logps!r:.80}")
        if c.get("finish_reason") not in FINISH_REASONS:
            raise VLLMServerError(f"choice {c['index']} finished with reason {c.get('finish_reason')!r}")
        out.append(Completion(list(ids), [float("nan") if v is None else float(v) for v in logps],
                              c["finish_reason"], version, c.get("text", "")))
    return [out[i * n:(i + 1) * n] for i in range(n_prompts)]


def _find_key(tree, key: str):
    """The first value stored under `key` anywhere in a JSON tree (the server's config layout varies)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, list):
        for item in tree:
            found = _find_key(item, key)
            if found is not None:
                return found
    return None
