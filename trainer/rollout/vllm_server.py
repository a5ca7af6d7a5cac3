"""vLLM rollout engine over a running vLLM OpenAI-compatible server: `VLLMServerEngine`, and its weight sync
(a checkpoint reload from a shared directory anywhere, or vLLM's NCCL transfer on GPUs).

It needs nothing from vLLM on the trainer side for generation and the reload sync (HTTP and safetensors only).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Iterable
from pathlib import Path

import torch

from trainer.extras import MissingExtraError
from trainer.rollout.base import Completion, SamplingParams
from trainer.rollout.vllm_engine import FINISH_REASONS, repeat_greedy

log = logging.getLogger("grpoflow.rollout.vllm")


class VLLMServerError(RuntimeError):
    """The vLLM server could not be reached or answered with an error; the message names the request."""


class VLLMServerEngine:
    """Rollout engine over an already-running vLLM OpenAI-compatible server (separate devices or machines).

    Generation goes through `/v1/completions` with token-id prompts (`return_token_ids`,
    `return_tokens_as_token_ids`, `logprobs: 0`) and needs nothing but the standard library. The server must
    run with `--logprobs-mode processed_logprobs` (checked at start through the dev-mode `/server_info`).

    Two ways to send the trainer's weights (`weight_sync`):
    - `"reload"` works anywhere the server can read `weights_dir` (the same machine, or shared storage): the
      tensors are written there as one safetensors file (tied `lm_head` included), then
      `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": ...}}` and
      `/reset_prefix_cache`. The server needs `VLLM_SERVER_DEV_MODE=1`. Measured on vLLM's CPU build.
    - `"nccl"` (GPUs): TRL's `VLLMClient` joins an NCCL group with the server's workers (the server started
      with `--weight-transfer-config '{"backend": "nccl"}'`, what `trl vllm-serve` runs); it needs `trl` and
      vLLM on the trainer side and the tensors on a CUDA device (`sync_device`). vLLM answers 500 to it
      without an accelerator. Not run in this project yet.
    `"auto"` is nccl when this process sees a GPU, else reload. With several trainer ranks only rank 0 holds
    this client (`engines.make_engine`): it alone sends the weights and asks for each batch, which it hands to
    the other ranks, so one weight-transfer communicator joins the server, never one per rank. `sleep` /
    `wake_up` call the server's dev-mode `/sleep` and `/wake_up` (no-ops on CPU). The old `trl vllm-serve`
    server (its own /generate/, no /v1/completions) is not supported.
    """

    def __init__(
        self,
        server_url: str,
        *,
        timeout_s: float = 600.0,
        model: str | None = None,
        weight_sync: str = "auto",
        weights_dir: str | os.PathLike | None = None,
        sync_device: str = "cuda:0",
        group_port: int = 51216,
    ):
        if weight_sync == "auto":
            weight_sync = "nccl" if torch.cuda.is_available() else "reload"
        if weight_sync not in ("nccl", "reload"):
            raise ValueError(f"weight_sync must be auto, nccl or reload, got {weight_sync!r}")
        self.url = server_url.rstrip("/")
        self.timeout_s = timeout_s
        self.weight_sync, self.sync_device, self.group_port = weight_sync, sync_device, group_port
        self._own_dir = weights_dir is None and weight_sync == "reload"
        self.weights_dir = (
            Path(tempfile.mkdtemp(prefix="grpoflow-vllm-weights-"))
            if self._own_dir
            else (Path(weights_dir) if weights_dir else None)
        )
        if self._own_dir:  # removed with the engine (or at exit)
            weakref.finalize(self, shutil.rmtree, self.weights_dir, True)
        self._request("GET", "/health", raw=True)
        self.model = model or self._request("GET", "/v1/models")["data"][0]["id"]
        self._check_logprobs_mode()
        self._client = None
        self.version = 0

    def _request(
        self,
        method: str,
        path: str,
        payload: dict | None = None,
        params: dict | None = None,
        raw: bool = False,
    ):
        url = self.url + path + (f"?{urllib.parse.urlencode(params, doseq=True)}" if params else "")
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(
            url, data=data, method=method, headers={"Content-Type": "application/json"}
        )
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
            log.warning(
                "%s has no /server_info (not in dev mode): assuming it runs with "
                "--logprobs-mode processed_logprobs",
                self.url,
            )
            return
        mode = _find_key(info, "logprobs_mode")
        if mode is not None and mode != "processed_logprobs":
            raise ValueError(
                f"the vLLM server at {self.url} runs with logprobs_mode={mode!r}; its log-probs "
                "ignore the sampling temperature. Restart it with --logprobs-mode processed_logprobs"
            )

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        greedy = sampling.temperature <= 0
        per_prompt = 1 if greedy else n
        payload = {
            "model": self.model,
            "prompt": [list(p) for p in prompts],
            "n": per_prompt,
            "temperature": 0.0 if greedy else sampling.temperature,
            "top_p": 1.0 if greedy else sampling.top_p,
            "max_tokens": sampling.max_tokens,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if sampling.seed is not None:
            payload["seed"] = sampling.seed
        if sampling.ignore_eos:
            payload["ignore_eos"] = True  # a vLLM extension of the OpenAI request
        body = self._request("POST", "/v1/completions", payload)
        groups = completions_from_response(body, len(prompts), per_prompt, self.version)
        return [repeat_greedy(g[0], n) for g in groups] if greedy else groups

    def _weight_client(self):
        if self._client is None:
            try:
                from trl.generation.vllm_client import VLLMClient
            except ImportError:
                try:
                    from trl.extras.vllm_client import VLLMClient
                except ImportError as e:
                    raise MissingExtraError(
                        "weight sync to a vLLM server uses TRL's VLLMClient and vLLM's NCCL "
                        "helpers on the trainer side: pip install '.[vllm]' 'trl>=1.16'"
                    ) from e
            self._client = VLLMClient(
                base_url=self.url, group_port=self.group_port, connection_timeout=self.timeout_s
            )
            self._client.init_communicator(device=self.sync_device)
        return self._client

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Checkpoint-format tensors (HF names; pass `model.state_dict()`, tied `lm_head` included) to the
        server."""
        if self.weight_sync == "reload":
            self._reload_from_dir(named_tensors, version)
        else:
            self._send_nccl(named_tensors)
        self.version = version

    def _reload_from_dir(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        from safetensors.torch import save_file

        target = self.weights_dir / f"v{version}"
        partial = self.weights_dir / f".v{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        # one file, each tensor its own copy (safetensors refuses tensors that share memory, i.e. tied ones)
        save_file(
            {name: t.detach().to("cpu", copy=True).contiguous() for name, t in named_tensors},
            str(partial / "model.safetensors"),
            metadata={"format": "pt"},
        )
        shutil.rmtree(target, ignore_errors=True)
        os.replace(partial, target)  # the server never reads a half-written file
        try:
            self._request(
                "POST",
                "/collective_rpc",
                {
                    "method": "reload_weights",
                    "kwargs": {"weights_path": str(target), "is_checkpoint_format": True},
                },
            )
        except VLLMServerError as e:
            if "HTTP 404" in str(e):
                raise VLLMServerError(
                    f"{self.url} has no /collective_rpc: start the vLLM server with "
                    "VLLM_SERVER_DEV_MODE=1 for weight_sync 'reload'"
                ) from e
            raise
        self._request("POST", "/reset_prefix_cache", raw=True)  # prompt KV computed with the old weights
        for old in self.weights_dir.glob("v*"):  # the server has read them; keep only the current version
            if old != target and old.name[1:].isdigit():
                shutil.rmtree(old, ignore_errors=True)

    def _send_nccl(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        client = self._weight_client()
        named = [(name, t.detach().to(self.sync_device)) for name, t in named_tensors]
        if hasattr(client, "update_named_params"):  # TRL >= 1.x: one announced, streamed update
            meta = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in named]
            client.update_named_params(meta, iter(named))
        else:
            for name, t in named:
                client.update_named_param(name, t)
        client.reset_prefix_cache()

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
        raise VLLMServerError(
            f"expected {n_prompts * n} choices ({n_prompts} prompts x {n}), got {len(choices)}"
        )
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
        out.append(
            Completion(
                list(ids),
                [float("nan") if v is None else float(v) for v in logps],
                c["finish_reason"],
                version,
                c.get("text", ""),
            )
        )
    return [out[i * n : (i + 1) * n] for i in range(n_prompts)]


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
