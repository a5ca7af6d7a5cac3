"""The transformers-backed OpenAI-compatible server: FastAPI routes over one batched `HFEngine`.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /health`.
Concurrent requests meet in a `Batcher`: a worker thread takes the first waiting request, gathers what
else arrives within a few milliseconds (up to `max_batch_size` requests), groups them by sampling
settings and runs one `HFEngine.generate` per group. `/health` counts `batches` and `requests`, so a
client can see that batching happened.

Honoured request fields: `messages` / `prompt`, `max_tokens` (or `max_completion_tokens`), `temperature`
(0 is greedy), `top_p`, `n`, `seed`, `stop`. Other OpenAI fields are accepted and ignored, except
`stream: true`, which is refused (use the vLLM engine for streaming). A seeded sampled request runs in a
batch of its own, so its seed alone decides its tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import signal
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from trainer.heldout import encode_prompts
from trainer.rollout.base import Completion, SamplingParams

_unique = itertools.count()


@dataclass
class _Job:
    prompts: list[list[int]]
    n: int
    sampling: SamplingParams
    future: Future = field(default_factory=Future)

    @property
    def key(self) -> tuple:
        """Jobs with equal keys can share one `generate` call."""
        s = self.sampling
        if s.temperature <= 0:  # greedy: top_p and seed change nothing
            return (self.n, s.max_tokens, 0.0)
        if s.seed is not None:  # a shared generator would make its tokens depend on its batch-mates
            return ("seeded", next(_unique))
        return (self.n, s.max_tokens, s.temperature, s.top_p)


class Batcher:
    """Gathers concurrent requests into batched `engine.generate` calls on one worker thread."""

    def __init__(self, engine, max_batch_size: int = 16, window_s: float = 0.005):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.engine, self.max_batch_size, self.window_s = engine, max_batch_size, window_s
        self.batches = self.requests = 0
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="grpoflow-batcher", daemon=True)
        self._thread.start()

    def submit(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> Future:
        """A future of `n` completions per prompt, in prompt order."""
        job = _Job(prompts, n, sampling)
        self._queue.put(job)
        return job.future

    def close(self, timeout_s: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            jobs, stopping = self._gather(first)
            groups: dict[tuple, list[_Job]] = {}
            for job in jobs:
                groups.setdefault(job.key, []).append(job)
            for group in groups.values():
                self._generate(group)
            if stopping:
                return

    def _gather(self, first: _Job) -> tuple[list[_Job], bool]:
        """`first` plus whatever is queued or arrives within the window; True if asked to stop meanwhile."""
        jobs, deadline = [first], time.monotonic() + self.window_s
        while len(jobs) < self.max_batch_size:
            try:
                job = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if job is None:
                return jobs, True
            jobs.append(job)
        return jobs, False

    def _generate(self, group: list[_Job]) -> None:
        prompts = [p for job in group for p in job.prompts]
        try:
            outputs = self.engine.generate(prompts, group[0].n, group[0].sampling)
        except Exception as e:  # noqa: BLE001 - the requests get the error, the server stays up
            for job in group:
                job.future.set_exception(e)
            return
        self.batches += 1
        self.requests += len(group)
        start = 0
        for job in group:
            job.future.set_result(outputs[start:start + len(job.prompts)])
            start += len(job.prompts)


# ---- requests ---------------------------------------------------------------------------------------------

class _Sampled(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False


class ChatRequest(_Sampled):
    messages: list[dict] = Field(min_length=1)


class CompletionRequest(_Sampled):
    prompt: str | list[str] | list[int] | list[list[int]]


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def _text_of(message: dict, index: int) -> dict:
    """A chat message with string content (OpenAI also allows a list of text parts)."""
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise ApiError(400, f"messages[{index}]: only text content parts are supported", "messages")
        content = "".join(p.get("text", "") for p in content)
    if not isinstance(message.get("role"), str) or not isinstance(content, str | None):
        raise ApiError(400, f"messages[{index}] needs a string 'role' and text 'content'", "messages")
    return {**message, "content": content or ""}


def _stop_at(completion: Completion, stops: list[str], tokenizer) -> tuple[str, int, str]:
    """(text, tokens counted, finish_reason) after cutting the text at the first stop string."""
    text, ids = completion.text, completion.token_ids
    cuts = [text.find(s) for s in stops if s and s in text]
    if not cuts:
        return text, len(ids), completion.finish_reason
    # the shortest token prefix whose text reaches the stop string (prefix texts grow monotonically)
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in tokenizer.decode(ids[:mid], skip_special_tokens=True) for s in stops if s):
            hi = mid
        else:
            lo = mid + 1
    return text[:min(cuts)], lo, "stop"


# ---- the app ----------------------------------------------------------------------------------------------

def build_app(engine, tokenizer, model_name: str, batcher: Batcher, context_length: int | None) -> FastAPI:
    """The FastAPI app serving `engine` (an `HFEngine`) as `model_name`; `batcher` wraps the same engine."""
    app = FastAPI(title=f"grpoflow: {model_name}")
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return _error(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(400, f"{where or 'request'}: {first.get('msg', 'invalid request')}", where or None)

    @app.get("/health")
    def health():
        return {"status": "ok", "model": model_name, "engine": "transformers",
                "batches": batcher.batches, "requests": batcher.requests}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "grpoflow", "max_model_len": context_length}]}

    def sampling_for(req: _Sampled, prompts: list[list[int]]) -> SamplingParams:
        if req.model not in (None, "", model_name):
            raise ApiError(404, f"the model `{req.model}` does not exist; this server serves `{model_name}`",
                           "model")
        if req.stream:
            raise ApiError(400, "stream=true is not supported by the transformers engine (the vLLM engine "
                                "streams)", "stream")
        longest = max(len(p) for p in prompts)
        max_tokens = req.max_tokens or req.max_completion_tokens
        if context_length is not None:
            max_tokens = max_tokens or context_length - longest
            if longest + max_tokens > context_length:
                raise ApiError(400, f"this model's maximum context length is {context_length} tokens; the "
                                    f"request needs {longest} prompt + {max_tokens} completion tokens",
                               "max_tokens")
        temperature = 1.0 if req.temperature is None else req.temperature
        return SamplingParams(max_tokens=max_tokens or 256, temperature=temperature,
                              top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed)

    async def run(req: _Sampled, prompts: list[list[int]]):
        sampling = sampling_for(req, prompts)
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        try:
            groups = await asyncio.wrap_future(batcher.submit(prompts, req.n, sampling))
        except Exception as e:  # noqa: BLE001 - reported to the client, logged by uvicorn's caller
            raise ApiError(500, f"generation failed: {type(e).__name__}: {e}") from e
        outs = [_stop_at(c, stops, tokenizer) for group in groups for c in group]
        usage = {"prompt_tokens": sum(len(p) for p in prompts), "completion_tokens": sum(k for _, k, _ in outs)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return outs, usage

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, f"{model_name} has no chat template; use /v1/completions")
        messages = [_text_of(m, i) for i, m in enumerate(req.messages)]
        prompts = encode_prompts(tokenizer, [{"prompt": messages}])
        outs, usage = await run(req, prompts)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": model_name, "usage": usage,
                "choices": [{"index": i, "message": {"role": "assistant", "content": text},
                             "finish_reason": reason, "logprobs": None}
                            for i, (text, _, reason) in enumerate(outs)]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        prompts = [tokenizer(p).input_ids if isinstance(p, str) else list(p) for p in prompt]
        vocab = len(tokenizer)
        if not prompts or any(not p or not all(0 <= t < vocab for t in p) for p in prompts):
            raise ApiError(400, f"prompt: each prompt needs at least one token, token ids in [0, {vocab})",
                           "prompt")
        outs, usage = await run(req, prompts)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name, "usage": usage,
                "choices": [{"index": i, "text": text, "finish_reason": reason, "logprobs": None}
                            for i, (text, _, reason) in enumerate(outs)]}

    return app


# ---- running it -------------------------------------------------------------------------------------------

def run_server(checkpoint: str, *, host: str, port: int, model_name: str, max_batch_size: int,
               on_ready) -> dict:
    """Load `checkpoint`, serve it until SIGTERM/SIGINT, return `{"batches", "requests"}`.

    `on_ready(url)` is called once the socket accepts requests. Port 0 takes a free port.
    """
    import torch
    import uvicorn
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from trainer.rollout.hf_engine import HFEngine

    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()  # a log file gets no progress bars
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32 if device == "cpu" else "auto")
    model.to(device).eval()
    engine = HFEngine(model, tokenizer)
    batcher = Batcher(engine, max_batch_size=max_batch_size)
    app = build_app(engine, tokenizer, model_name, batcher,
                    getattr(model.config, "max_position_embeddings", None))

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    url_host = f"[{host}]" if ":" in host else host
    url = f"http://{url_host}:{sock.getsockname()[1]}/v1"

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started and not self.should_exit:
                on_ready(url)

    server = Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                                   lifespan="off"))
    # uvicorn re-raises the signal that stopped it once it has shut down; these handlers take it instead,
    # so the process ends with status 0 and can report what it served.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if main_thread:
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    try:
        server.run(sockets=[sock])
    finally:
        batcher.close()
        sock.close()
        if main_thread:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return {"batches": batcher.batches, "requests": batcher.requests}
