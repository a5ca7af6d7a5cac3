"""Rewards scored by a model behind an OpenAI-compatible endpoint (`kind: model` in a recipe).

Two modes, both fed the text `template` makes of each prompt and completion (`{prompt}`, `{completion}` and
`{answer}` are replaced; nothing else in the template is touched, so JSON braces need no escaping):
- `judge`, a generative judge: the texts go to `<endpoint>/completions` (a list of prompts per request, as the
  OpenAI API allows) and the reward is the number that `verdict`, a regular expression with one group, finds
  last in the judge's answer. Model text is only matched, never evaluated.
- `score`, a scoring endpoint (a reward model): the texts go to `<endpoint>/pooling` (vLLM's API:
  `{"model", "input": [...]}` in, `{"data": [{"index", "data"}]}` out) and the reward is each `data`, a number
  or a list holding one number.

Requests carry `batch_size` completions each, at most `concurrency` at once. Each request is bounded whole by
`timeout_s` (connecting, sending, waiting and reading: a watchdog shuts its socket down at the deadline) and
is tried `1 + retries` times when it times out, cannot connect or is answered 429 or 5xx. A completion whose
request still fails, or whose verdict cannot be read, is an exception in the returned list: `RewardRunner`
gives it None and counts it in `rewards/<name>/errors`, never waiting longer than its own timeout.

The API key is read from the environment variable named by `api_key_env` when the reward is built and sent as
a Bearer token; it is never part of a message or a repr. An endpoint carrying credentials itself (userinfo,
`?api_key=`) is refused, since the recipe is logged with its runs; endpoints are shown through `mask_uri`.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field

from data.redact import has_credentials, mask_uri
from trainer.rewards.parsing import completion_text

MAX_ANSWER_BYTES = 1 << 22  # a batch of verdicts or scores is kilobytes; more is not an answer to read
DEFAULT_JUDGE_TEMPLATE = (
    "Rate how well the response answers the question, from 0 (wrong) to 1 (right).\n"
    "Question: {prompt}\nReference answer: {answer}\nResponse: {completion}\nScore:"
)
DEFAULT_VERDICT = r"(?i)(?:score\s*[:=]\s*|^\s*)(-?\d+(?:\.\d+)?)"
_PLACEHOLDERS = ("{prompt}", "{completion}", "{answer}")


class ModelRewardError(RuntimeError):
    """A completion the reward model could not score: its request failed or its verdict was unreadable."""


@dataclass(frozen=True)
class ModelRewardSettings:
    """How a `kind: model` reward reaches its endpoint; `args` of the recipe entry are these fields."""

    endpoint: str
    mode: str = "judge"
    model: str | None = None
    template: str | None = None
    verdict: str = DEFAULT_VERDICT
    api_key_env: str | None = None
    timeout_s: float = 30.0
    retries: int = 2
    concurrency: int = 4
    batch_size: int = 8
    max_tokens: int = 32
    _pattern: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        parts = urllib.parse.urlsplit(self.endpoint) if isinstance(self.endpoint, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"endpoint: expected an http(s) URL such as http://host:8000/v1, "
                f"got {mask_uri(str(self.endpoint))!r}"
            )
        if has_credentials(self.endpoint):  # the recipe is logged and stored with its runs: no secrets in it
            raise ValueError(
                f"endpoint: {mask_uri(self.endpoint)!r} carries credentials; name the environment variable "
                "holding the key in args.api_key_env instead"
            )
        for name in ("model", "template", "api_key_env"):
            if not isinstance(getattr(self, name), (str, type(None))):
                raise ValueError(f"args.{name}: expected a string, got {getattr(self, name)!r}")
        if self.mode not in ("judge", "score"):
            raise ValueError(f"args.mode: expected 'judge' or 'score', got {self.mode!r}")
        if self.template is not None and "{completion}" not in self.template:
            raise ValueError("args.template: must contain {completion}")
        try:
            pattern = re.compile(self.verdict)
        except (re.error, TypeError) as error:
            raise ValueError(f"args.verdict: not a regular expression ({error})") from None
        if pattern.groups != 1:
            raise ValueError(f"args.verdict: needs exactly one group (the number), has {pattern.groups}")
        object.__setattr__(self, "_pattern", pattern)
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
            raise ValueError(f"args.timeout_s: expected seconds in (0, 3600], got {timeout!r}")
        # Upper bounds far past any real setting, so that a typo is an error rather than a million threads.
        for name, low, high in (
            ("retries", 0, 10),
            ("concurrency", 1, 256),
            ("batch_size", 1, 1 << 16),
            ("max_tokens", 1, 1 << 20),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"args.{name}: expected a whole number from {low} to {high}, got {value!r}")
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ValueError(f"args.api_key_env: environment variable {self.api_key_env!r} is not set")

    @property
    def shown_endpoint(self) -> str:
        return mask_uri(self.endpoint)


def retry_pause(attempt: int) -> float:
    """Seconds a request waits before its retry after failed attempt `attempt` (0-based): doubling from
    0.1 s, at most 2 s."""
    return min(0.1 * 2**attempt, 2.0)


def outlasting_rewards(rewards, reward_timeout_s: float) -> list[str]:
    """A warning for each `kind: model` entry of `rewards` (the recipe's RewardSpecs) whose single request,
    with its retries and their pauses, may take longer than the whole reward call is given
    (`train.reward_timeout_s`): the trainer would abandon the call, and count its whole batch as errors,
    before the entry's own retries are through."""
    warnings = []
    for i, spec in enumerate(rewards):
        if spec.kind != "model":
            continue
        settings = ModelRewardSettings(endpoint=spec.endpoint, **spec.args)
        pauses = sum(retry_pause(attempt) for attempt in range(settings.retries))
        worst = settings.timeout_s * (settings.retries + 1) + pauses
        if worst > reward_timeout_s:
            warnings.append(
                f"rewards[{i}] ({spec.label}): one request may take {worst:g} s with its retries "
                f"(args.timeout_s {settings.timeout_s:g} x {settings.retries + 1} tries), more than "
                f"train.reward_timeout_s={reward_timeout_s:g} gives the whole call: a slow endpoint's batch "
                "is abandoned and counted as errors before its retries end. Raise train.reward_timeout_s "
                "(or lower args.timeout_s / args.retries)"
            )
    return warnings


def model_reward(endpoint: str, **args):
    """The reward function of a `kind: model` entry: `f(prompts, completions, **columns)` scoring through
    the endpoint; raises ValueError naming the bad setting."""
    settings = ModelRewardSettings(endpoint=endpoint, **args)
    key = os.environ[settings.api_key_env] if settings.api_key_env else None
    client = _EndpointClient(settings, key)
    template = settings.template or (
        DEFAULT_JUDGE_TEMPLATE if settings.mode == "judge" else "{prompt}\n{completion}"
    )

    def reward(prompts: Sequence, completions: Sequence, **columns) -> list:
        answers = columns.get("answer")
        texts = [
            _fill(
                template,
                _question(p),
                completion_text(c),
                "" if answers is None or len(answers) != len(completions) else str(answers[i]),
            )
            for i, (p, c) in enumerate(zip(prompts, completions, strict=True))
        ]
        return client.score(texts)

    reward.__name__ = f"model_reward_{settings.mode}"
    return reward


def _question(prompt) -> str:
    """A prompt's text for the judge: a chat prompt's last user message (not its system prompt)."""
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users:
            return completion_text(users[-1])
    return completion_text(prompt)


def _fill(template: str, prompt: str, completion: str, answer: str) -> str:
    # One pass over the template, so a completion containing "{answer}" is never filled in itself.
    values = dict(zip(_PLACEHOLDERS, (prompt, completion, answer), strict=True))
    return re.sub("|".join(re.escape(p) for p in _PLACEHOLDERS), lambda m: values[m.group(0)], template)


class _EndpointClient:
    def __init__(self, settings: ModelRewardSettings, key: str | None):
        self.settings = settings
        self._key = key  # not in any message: errors show the masked endpoint only
        base = settings.endpoint.rstrip("/")
        self.url = base + ("/completions" if settings.mode == "judge" else "/pooling")

    def __repr__(self) -> str:
        return f"_EndpointClient({self.settings.shown_endpoint!r}, mode={self.settings.mode!r})"

    def score(self, texts: list[str]) -> list:
        size = self.settings.batch_size
        batches = [texts[i : i + size] for i in range(0, len(texts), size)]
        results: list[list] = [[] for _ in batches]
        pending = iter(range(len(batches)))
        lock = threading.Lock()

        def work() -> None:
            while True:
                with lock:
                    i = next(pending, None)
                if i is None:
                    return
                try:
                    results[i] = self._batch(batches[i])
                except Exception as error:  # a bug here still fails only these completions
                    results[i] = [error] * len(batches[i])

        # Daemon threads, not an executor (joined at interpreter exit); each request is bounded whole, so
        # joining them is bounded too.
        workers = [
            threading.Thread(target=work, name="model-reward", daemon=True)
            for _ in range(max(1, min(self.settings.concurrency, len(batches))))
        ]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
        return [value for batch in results for value in batch]

    def _batch(self, texts: list[str]) -> list:
        try:
            answer = self._post_with_retries(self._payload(texts))
            return self._read(answer, len(texts))
        except ModelRewardError as error:
            return [error] * len(texts)

    def _payload(self, texts: list[str]) -> dict:
        s = self.settings
        payload: dict = {"model": s.model} if s.model else {}
        if s.mode == "judge":
            return {**payload, "prompt": texts, "max_tokens": s.max_tokens, "temperature": 0.0}
        return {**payload, "input": texts}

    def _post_with_retries(self, payload: dict):
        attempts = self.settings.retries + 1
        for attempt in range(attempts):
            try:
                return _post_json(self.url, payload, self._key, self.settings.timeout_s)
            except _Retryable as error:
                if attempt + 1 == attempts:
                    raise ModelRewardError(
                        f"{mask_uri(self.url)}: {error} (tried {attempts} time{'s' * (attempts > 1)})"
                    ) from None
                time.sleep(retry_pause(attempt))
        raise AssertionError("unreachable")

    def _read(self, answer, n: int) -> list:
        where = mask_uri(self.url)
        key = "choices" if self.settings.mode == "judge" else "data"
        items = answer.get(key) if isinstance(answer, dict) else None
        if not isinstance(items, list) or len(items) != n:
            got = len(items) if isinstance(items, list) else "no"
            raise ModelRewardError(f"{where}: expected {n} {key!r} in the answer, got {got}")
        ordered: list = [ModelRewardError(f"{where}: no {key!r} item for this completion")] * n
        for position, item in enumerate(items):
            index = item.get("index", position) if isinstance(item, dict) else position
            if isinstance(index, int) and 0 <= index < n:
                ordered[index] = self._value(item, where)
        return ordered

    def _value(self, item, where: str):
        if self.settings.mode == "judge":
            text = item.get("text") if isinstance(item, dict) else None
            if not isinstance(text, str):
                return ModelRewardError(f"{where}: a choice without text")
            found = self.settings._pattern.findall(text)
            try:
                return float(found[-1])
            except (IndexError, ValueError):
                return ModelRewardError(f"{where}: no verdict in the judge's answer {text[:80]!r}")
        value = item.get("data") if isinstance(item, dict) else None
        while isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        return ModelRewardError(f"{where}: a score that is not one number: {str(value)[:80]}")


class _Retryable(Exception):
    """A request that failed in a way worth trying again: a timeout, no connection, 429 or 5xx."""


def _post_json(url: str, payload: dict, key: str | None, timeout_s: float):
    """POST `payload` as JSON to `url` and return the decoded answer, all within `timeout_s` seconds."""
    parts = urllib.parse.urlsplit(url)
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parts.hostname, parts.port, timeout=timeout_s)
    body = json.dumps(payload).encode()
    headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    expired = threading.Event()
    sockets: list[socket.socket] = []  # http.client drops conn.sock when the answer closes the connection

    def shut() -> None:  # wakes a read blocked in this thread; the socket timeout alone bounds each read only
        expired.set()
        for sock in list(sockets):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout_s, shut)
    timer.daemon = True
    timer.start()
    try:
        conn.connect()  # within `timeout_s`, the connection's own timeout
        sockets.append(conn.sock)
        if expired.is_set():
            shut()
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read(MAX_ANSWER_BYTES + 1)
    except (OSError, http.client.HTTPException) as error:
        if expired.is_set() or isinstance(error, TimeoutError):
            raise _Retryable(f"no complete answer within {timeout_s:g} s") from None
        raise _Retryable(f"{type(error).__name__}: {error}") from None
    finally:
        timer.cancel()
        conn.close()
    if expired.is_set():
        raise _Retryable(f"no complete answer within {timeout_s:g} s")
    if response.status == 429 or response.status >= 500:
        raise _Retryable(f"HTTP {response.status}")
    if response.status != 200:
        raise ModelRewardError(f"{mask_uri(url)}: HTTP {response.status}: {data[:200]!r}")
    if len(data) > MAX_ANSWER_BYTES:
        raise ModelRewardError(f"{mask_uri(url)}: answer over {MAX_ANSWER_BYTES} bytes")
    try:
        return json.loads(data)
    except ValueError:
        raise ModelRewardError(f"{mask_uri(url)}: answer is not JSON: {data[:80]!r}") from None
