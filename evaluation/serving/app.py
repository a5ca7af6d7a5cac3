"""The transformers-backed OpenAI-compatible server: FastAPI routes over one `HFEngine` shared fairly.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /health` (open: no
key, no request data; it counts `batches`, `requests`, `cancelled`, `timed_out`, `active` and `waiting`).
Generation is `scheduler.Scheduler`: token slices in turn, so a small request is not starved by a
big one, and a request whose client disconnects or whose `--request-timeout` passes stops being generated.

With an API key, every request but `/health` needs it (`/docs`, `/redoc` and `/openapi.json` too), the
`Bearer` scheme in any case, the key compared in constant time. A request is checked in this order: API key
(401), body size (413, before it is read in full), JSON and every field (400 naming the field, also for the
`ServerLimits`), then generation (504 past the timeout). A body must arrive within `--body-timeout` (and
`--request-timeout`) of its headers (408).
Parsing, tokenizing and cutting at stop strings run in worker threads, never on the event loop, so
`/health` answers while a big body is being handled.

Honoured request fields: `messages` / `prompt`, `max_tokens` (or `max_completion_tokens`), `temperature`
(0 is greedy), `top_p`, `n`, `seed`, `stop`, and vLLM's `ignore_eos` (decode `max_tokens` tokens even past
EOS: for load tests and benchmarks). Other OpenAI fields are accepted and ignored, except
`stream: true`, which is refused (use the vLLM engine for streaming). A seeded sampled request runs in a
batch of its own, so its seed alone decides its tokens.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from data.text import SURROGATE_PROBLEM, unpaired_surrogate
from evaluation.serving.guards import ServerLimits
from evaluation.serving.scheduler import Job, Scheduler
from trainer.prompts import encode_prompts
from trainer.rollout.base import Completion, SamplingParams

log = logging.getLogger("grpoflow.serve")
_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
_GREEDY_BELOW = 1e-5  # a smaller temperature is greedy (as in vLLM): logits / T would overflow
_MAX_TOKENS_WITHOUT_CONTEXT = 4096  # for a model that declares no context length, unless --max-tokens says


class _Sampled(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=_SEED_RANGE[0], le=_SEED_RANGE[1])
    stop: str | list[str] | None = None
    stream: bool | None = False
    ignore_eos: bool = False


class ChatRequest(_Sampled):
    messages: list[dict] = Field(min_length=1)


class CompletionRequest(_Sampled):
    prompt: str | list[str] | list[int] | list[list[int]]


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout",
    413: "invalid_request_error",
    504: "timeout",
}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}`."""
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(
        {
            "error": {
                "message": message,
                "type": _KINDS.get(status, "server_error"),
                "param": param,
                "code": status,
            }
        },
        status,
        headers=headers,
    )


def _bearer_token(authorization: bytes) -> bytes | None:
    """The credentials of an `Authorization: Bearer <token>` header; the scheme is case-insensitive
    (RFC 7235)."""
    scheme, _, token = authorization.strip().partition(b" ")
    return token.strip(b" \t") if scheme.lower() == b"bearer" else None


class _RequireKey:
    """ASGI middleware: every request but `/health` must carry the key (the docs and the schema too)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            token = _bearer_token(given)
            if token is None or not hmac.compare_digest(token, self.key):
                refusal = error_response(
                    401, "a valid API key is required: send 'Authorization: Bearer <key>'", "authorization"
                )
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)


def _text_of(message: dict, index: int) -> dict:
    """A chat message with string content (OpenAI also allows a list of text parts)."""
    content = message.get("content")
    if isinstance(content, list):
        if not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text", ""), str)
            for p in content
        ):
            raise ApiError(400, f"messages[{index}]: only text content parts are supported", "messages")
        content = "".join(p.get("text", "") for p in content)
    if not isinstance(message.get("role"), str) or not isinstance(content, str | None):
        raise ApiError(400, f"messages[{index}] needs a string 'role' and text 'content'", "messages")
    return {**message, "content": content or ""}


def _stop_at(completion: Completion, stops: list[str], tokenizer) -> tuple[str, int, str]:
    """(text, tokens counted, finish_reason) after cutting the text at the first stop string."""
    text, ids = completion.text, completion.token_ids
    found = [s for s in stops if s and s in text]
    if not found:
        return text, len(ids), completion.finish_reason
    # the shortest token prefix whose text reaches a stop string (prefix texts grow monotonically, so only
    # the strings found in the whole text can be in a prefix); one decode per step of the search
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        prefix = tokenizer.decode(ids[:mid], skip_special_tokens=True)
        if any(s in prefix for s in found):
            hi = mid
        else:
            lo = mid + 1
    return text[: min(text.find(s) for s in found)], lo, "stop"


class _Prepared:
    """A checked request: its prompts as token ids, sampling settings and stop strings."""

    def __init__(
        self, kind: str, prompts: list[list[int]], n: int, sampling: SamplingParams, stops: list[str]
    ):
        self.kind, self.prompts, self.n, self.sampling, self.stops = kind, prompts, n, sampling, stops


class _Parser:
    """Turns a request body into a `_Prepared`, raising `ApiError(400, ...)` naming the field. Runs in a
    thread."""

    def __init__(self, tokenizer, model_name: str, context_length: int | None, limits: ServerLimits):
        self.tokenizer, self.model_name, self.context_length, self.limits = (
            tokenizer,
            model_name,
            context_length,
            limits,
        )
        self._lock = threading.Lock()  # a fast tokenizer is not safe to call from several threads at once

    def parse(self, kind: str, body: bytes) -> _Prepared:
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the decoder goes
            raise ApiError(
                400, f"body: not valid JSON ({type(e).__name__}: {str(e)[:200]})", "body"
            ) from None
        if not isinstance(data, dict):
            raise ApiError(400, f"body: expected a JSON object, got {type(data).__name__}", "body")
        if (where := unpaired_surrogate(data)) is not None:  # the tokenizer or the reply would fail on it
            field = re.split(r"[.\[]", where, maxsplit=1)[0]
            raise ApiError(400, f"{where}: {SURROGATE_PROBLEM}", field if field in data else "body")
        try:
            req = (ChatRequest if kind == "chat" else CompletionRequest).model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "body"
            raise ApiError(
                400, f"{where}: {first.get('msg', 'invalid value')}", where.split(".")[0]
            ) from None
        if req.model not in (None, "", self.model_name):
            raise ApiError(
                404,
                f"the model `{req.model}` does not exist; this server serves `{self.model_name}`",
                "model",
            )
        if req.stream:
            raise ApiError(
                400,
                "stream: stream=true is not supported by the transformers engine (the vLLM engine streams)",
                "stream",
            )
        stops = self._stops(req.stop)
        prompts = self._chat_prompts(req.messages) if kind == "chat" else self._completion_prompts(req.prompt)
        limit = self.limits.max_sequences
        if len(prompts) * req.n > limit:
            raise ApiError(
                400,
                f"n: {len(prompts)} prompt(s) x n={req.n} asks for {len(prompts) * req.n} "
                f"completions; this server allows {limit} per request (--max-sequences)",
                "n",
            )
        return _Prepared(kind, prompts, req.n, self._sampling(req, prompts), stops)

    def _stops(self, stop) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > self.limits.max_stop:
            raise ApiError(
                400,
                f"stop: {len(stops)} stop strings; this server allows {self.limits.max_stop} (--max-stop)",
                "stop",
            )
        longest = max((len(s) for s in stops), default=0)
        if longest > self.limits.max_stop_length:
            raise ApiError(
                400,
                f"stop: a stop string of {longest} characters; this server allows "
                f"{self.limits.max_stop_length} (--max-stop-length)",
                "stop",
            )
        return stops

    def _chat_prompts(self, messages: list[dict]) -> list[list[int]]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(
                400, f"messages: {self.model_name} has no chat template; use /v1/completions", "messages"
            )
        clean = [_text_of(m, i) for i, m in enumerate(messages)]
        try:
            with self._lock:
                return encode_prompts(self.tokenizer, [{"prompt": clean}])
        # a template refusing these messages (roles, order) is the client's
        except Exception as e:  # noqa: BLE001
            raise ApiError(
                400,
                f"messages: the chat template refused them: {type(e).__name__}: {str(e)[:200]}",
                "messages",
            ) from None

    def _completion_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt or len(prompt) > self.limits.max_sequences:
            raise ApiError(
                400,
                f"prompt: between 1 and {self.limits.max_sequences} prompts per request "
                f"(--max-sequences), got {len(prompt)}",
                "prompt",
            )
        with self._lock:
            prompts = [self.tokenizer(p).input_ids if isinstance(p, str) else list(p) for p in prompt]
        vocab = len(self.tokenizer)
        for i, p in enumerate(prompts):
            if not p or not all(0 <= t < vocab for t in p):
                raise ApiError(
                    400,
                    f"prompt[{i}]: each prompt needs at least one token, token ids in [0, {vocab})",
                    "prompt",
                )
        return prompts

    def _sampling(self, req: _Sampled, prompts: list[list[int]]) -> SamplingParams:
        longest = max(len(p) for p in prompts)
        asked = req.max_tokens or req.max_completion_tokens
        field = "max_tokens" if req.max_tokens else "max_completion_tokens"
        cap = self.limits.max_tokens
        if asked is not None and cap is not None and asked > cap:
            raise ApiError(
                400, f"{field}: {asked} is over this server's limit of {cap} (--max-tokens)", field
            )
        if self.context_length is None:
            room = cap = cap or _MAX_TOKENS_WITHOUT_CONTEXT
            if asked is not None and asked > cap:
                raise ApiError(
                    400, f"{field}: {asked} is over this server's limit of {cap} (--max-tokens)", field
                )
        else:
            room = self.context_length - longest
            if room < 1:
                where = "prompt" if isinstance(req, CompletionRequest) else "messages"
                raise ApiError(
                    400,
                    f"{where}: {longest} prompt tokens leave no room in this model's maximum context "
                    f"length of {self.context_length} tokens",
                    where,
                )
            if asked is not None and asked > room:
                raise ApiError(
                    400,
                    f"{field}: this model's maximum context length is {self.context_length} tokens; "
                    f"the request needs {longest} prompt + {asked} completion tokens",
                    field,
                )
        if asked is None:
            asked = min(room, cap) if cap is not None else room
        temperature = 1.0 if req.temperature is None else req.temperature
        if temperature < _GREEDY_BELOW:
            temperature = 0.0
        return SamplingParams(
            max_tokens=asked,
            temperature=temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
        )


def _response(
    prepared: _Prepared, groups: list[list[Completion]], tokenizer, model_name: str, rid: str
) -> bytes:
    """The OpenAI response body, as bytes (built in a thread: stop cutting decodes)."""
    outs = [_stop_at(c, prepared.stops, tokenizer) for group in groups for c in group]
    prompt_tokens = sum(len(p) for p in prepared.prompts)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": sum(k for _, k, _ in outs)}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    if prepared.kind == "chat":
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "finish_reason": reason,
                "logprobs": None,
            }
            for i, (text, _, reason) in enumerate(outs)
        ]
        kind = "chat.completion"
    else:
        choices = [
            {"index": i, "text": text, "finish_reason": reason, "logprobs": None}
            for i, (text, _, reason) in enumerate(outs)
        ]
        kind = "text_completion"
    return json.dumps(
        {
            "id": rid,
            "object": kind,
            "created": int(time.time()),
            "model": model_name,
            "usage": usage,
            "choices": choices,
        }
    ).encode()


class _ClientGone(Exception):
    pass


# ---- the app ----------------------------------------------------------------------------------------------


def build_app(
    tokenizer,
    model_name: str,
    scheduler: Scheduler,
    context_length: int | None,
    limits: ServerLimits | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """The FastAPI app serving what `scheduler` generates as `model_name`."""
    limits = limits or ServerLimits()
    parser = _Parser(tokenizer, model_name, context_length, limits)
    app = FastAPI(title=f"grpoflow: {model_name}")
    if api_key:
        app.add_middleware(_RequireKey, key=api_key)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):  # uvicorn logs the traceback
        return error_response(500, f"internal error: {type(e).__name__}")

    @app.get("/health")
    async def health():  # on the event loop, not in a thread pool that busy requests may fill
        return {"status": "ok", "model": model_name, "engine": "transformers", **scheduler.stats()}

    @app.get("/v1/models")
    def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "grpoflow",
                    "max_model_len": context_length,
                }
            ],
        }

    async def read_body(request: Request) -> bytes:
        limit = limits.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise ApiError(400, f"content-length: not a byte count: {length[:40]!r}", "content-length")
            if int(length) > limit:
                raise ApiError(
                    413,
                    f"body: {int(length)} bytes; this server accepts at most {limit} (--max-body-bytes)",
                    "body",
                )
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(
                        413,
                        f"body: over {limit} bytes; this server accepts at most {limit} (--max-body-bytes)",
                        "body",
                    )
                chunks.append(chunk)
        except ClientDisconnect:
            raise _ClientGone from None
        return b"".join(chunks)

    async def disconnected(request: Request) -> None:
        """Returns once the client has gone (uvicorn says so after the body has been read)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def generate(request: Request, prepared: _Prepared, rid: str, deadline: float):
        loop = asyncio.get_running_loop()
        job: Job = scheduler.submit(prepared.prompts, prepared.n, prepared.sampling, name=rid)
        result, gone = asyncio.wrap_future(job.future), asyncio.ensure_future(disconnected(request))
        try:
            done, _ = await asyncio.wait(
                {result, gone}, timeout=max(0.0, deadline - loop.time()), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            gone.cancel()
        if result in done:
            if result.cancelled():
                raise ApiError(503, "the server is shutting down")
            try:
                return result.result()
            except Exception as e:  # noqa: BLE001 - the engine failed: the server's fault, not the request's
                log.error("%s: generation failed", rid, exc_info=e)
                raise ApiError(500, f"generation failed: {type(e).__name__}: {e}") from e
        if gone in done:
            scheduler.cancel(job, "the client disconnected")
            raise _ClientGone
        scheduler.cancel(job, f"timed out after {limits.request_timeout_s:g} s", timed_out=True)
        raise ApiError(
            504,
            f"the request took over {limits.request_timeout_s:g} s (--request-timeout); its "
            "generation was stopped: ask for fewer tokens or completions",
        )

    async def handle(request: Request, kind: str, prefix: str) -> Response:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.request_timeout_s
        upload_s, flag = min(
            (limits.body_timeout_s, "--body-timeout"), (limits.request_timeout_s, "--request-timeout")
        )
        try:
            body = await asyncio.wait_for(read_body(request), timeout=upload_s)
            prepared = await asyncio.to_thread(parser.parse, kind, body)
            rid = f"{prefix}-{uuid.uuid4().hex}"
            groups = await generate(request, prepared, rid, deadline)
        except TimeoutError:
            raise ApiError(408, f"body: not received within {upload_s:g} s ({flag})", "body") from None
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it
        content = await asyncio.to_thread(_response, prepared, groups, tokenizer, model_name, rid)
        return Response(content, media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "chat", "chatcmpl")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completion", "cmpl")

    return app
