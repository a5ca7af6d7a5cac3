"""The transformers rollout engine: batched sampling with a KV cache, for CPU and a single GPU.

Prompts are left-padded into one batch; each prompt's cache is computed once and shared by its `n`
completions (one copy that their decoded tokens attend over, `shared_prompt.py`, where the model allows;
else repeated `n` times); decoding stops per sequence at EOS and for the batch when all have stopped.
The loop is written out (rather than `model.generate`) because the trainer needs the behaviour
log-probabilities of exactly the sampled tokens under log_softmax(logits / T), and because on small
models the per-step overhead of `generate` dominates the arithmetic; for the same reason a decoding step of
a Qwen2 or Llama model is its forward's tensor operations written out (`decode_step.py`, bit-identical).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable

import torch

from trainer.rollout import decode_step, shared_prompt
from trainer.rollout.base import Completion, SamplingParams
from trainer.vision import VisionInputs, vision_forward_kwargs, vision_of


def cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def sample_next(
    logits: torch.Tensor,
    sampling: SamplingParams,
    generator: torch.Generator | None,
    rows: tuple[int, int] | None = None,
):
    """Sample one token per row; return (tokens, their log-probs under log_softmax(logits / T)).

    `rows` (first row, rows in the whole batch): these rows are a slice of a larger batch, and each is sampled
    with the random numbers it would get there."""
    logits = logits.float()
    if sampling.temperature <= 0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logp.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / sampling.temperature, dim=-1)
    probs = logp.exp()
    if sampling.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= sampling.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    # inverse-CDF sampling, one uniform number per row (the exponential race that torch.multinomial runs
    # draws one per row and token: at this vocabulary that was 5% of a small model's rollout), written out
    # so that a slice of a batch can take its rows of the whole batch's numbers
    first, total = rows if rows is not None else (0, probs.shape[0])
    u = torch.rand(total, 1, dtype=probs.dtype, device=probs.device, generator=generator)
    cdf = probs.cumsum(-1)
    # u * the row's mass (float sums keep it a hair off 1), kept below it so that rounding cannot pick a
    # token past the last with mass; right=True skips tokens with no mass
    mass = cdf[:, -1:]
    target = torch.minimum(
        u[first : first + probs.shape[0]] * mass, torch.nextafter(mass, torch.zeros_like(mass))
    )
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[1] - 1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


class HFEngine:
    """Rollout engine over a transformers causal LM held in this process."""

    def __init__(
        self, model, tokenizer, eos_token_ids: Iterable[int] | None = None, pad_token_id: int | None = None
    ):
        self.model = model
        self.tokenizer = tokenizer
        eos = list(eos_token_ids) if eos_token_ids is not None else _eos_ids(model, tokenizer)
        self.eos = torch.tensor(sorted(set(eos)), dtype=torch.long)
        self.pad_id = pad_token_id if pad_token_id is not None else (tokenizer.pad_token_id or eos[0])
        self.version = 0
        self._cache_kw = cache_kwarg(model)

    @property
    def device(self):
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        was_training = self.model.training
        self.model.eval()
        try:
            decoding = self.start(prompts, n, sampling)
            decoding.step()
            return decoding.results()
        finally:
            if was_training:
                self.model.train()

    def start(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> Decoding:
        """A generation that the caller advances a few tokens at a time (the model must be in eval mode).

        A server interleaves several of these so that a long request does not hold the model until it ends.
        """
        return Decoding(self, prompts, n, sampling)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"weight sync: the engine's model has no parameter {name!r}")
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))
        self.version = version

    def sleep(self, level: int = 1) -> None:
        # transformers has no sleep mode; on a GPU the trainer and this engine share one copy of the model.
        pass

    def wake_up(self, tags: list[str] | None = None) -> None:
        pass


class Decoding:
    """One batched generation in progress: the prefill is done on creation, `step(k)` decodes up to k tokens.

    Running `step()` to the end gives exactly what `HFEngine.generate` returns; its KV cache lives here.
    """

    @torch.no_grad()
    def __init__(self, engine: HFEngine, prompts: list[list[int]], n: int, sampling: SamplingParams):
        from transformers import DynamicCache

        model, device = engine.model, engine.device
        self.engine, self.n, self.sampling, self.num_prompts = engine, n, sampling, len(prompts)
        # one share of a larger batch: its rows sample the random numbers they would get in the whole batch
        self.share_rows = None if sampling.share is None else (sampling.share[0] * n, sampling.share[1] * n)
        self.generator = None
        if sampling.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(sampling.seed)
        ids, mask = left_pad(prompts, engine.pad_id, device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        inputs = {"position_ids": positions}
        vision = VisionInputs.concat([vision_of(p) for p in prompts])
        if (
            vision is not None
        ):  # images: the model's 3-D positions; the tokens after the prompt are text, their
            inputs = vision_forward_kwargs(model, ids, mask, vision)  # three position components equal
            positions = inputs["position_ids"][0]
        self.cache = DynamicCache(config=model.config)
        out = model(
            input_ids=ids,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=1,
            **{engine._cache_kw: self.cache},
            **inputs,
        )
        logits = out.logits[:, -1]
        batch = logits.shape[0] * n
        # one prefill per prompt, shared by its n completions: read once per token where the model allows
        # (shared_prompt.py), else repeated n times
        self.prompt_cache, self.written_out = None, False
        if vision is None and shared_prompt.supported(model, self.cache):
            self.prompt_cache = shared_prompt.PromptCache.from_prefill(self.cache, mask, n)
            # the model's decoding forward written out as its tensor operations, where it can be
            self.written_out = decode_step.supported(model)
            self.cache = own_tokens_cache(model.config, self.prompt_cache, batch, sampling.max_tokens - 1)
            mask = None  # the decoding attends with no mask (the padding is in prompt_cache)
        else:
            if n > 1:
                self.cache.batch_repeat_interleave(n)
                mask = mask.repeat_interleave(n, dim=0)
            reserve_room(self.cache, ids.shape[1] + max(sampling.max_tokens - 1, 0))
        if n > 1:
            logits = logits.repeat_interleave(n, dim=0)
            positions = positions.repeat_interleave(n, dim=0)
        self.logits, self.mask, self.next_pos = logits, mask, positions[:, -1] + 1
        self.eos = engine.eos.to(device)
        self.done_rows = torch.zeros(batch, dtype=torch.bool, device=device)
        self.tokens_out = torch.full(
            (batch, sampling.max_tokens), engine.pad_id, dtype=torch.long, device=device
        )
        self.logps_out = torch.zeros((batch, sampling.max_tokens), device=device)
        self.lengths = torch.full((batch,), sampling.max_tokens, dtype=torch.long, device=device)
        self.t = 0  # tokens decoded so far
        self.done = sampling.max_tokens < 1

    @property
    def rows(self) -> int:
        return self.tokens_out.shape[0]

    @torch.no_grad()
    def step(self, tokens: int | None = None) -> None:
        """Decode up to `tokens` more tokens (all that remain when None); sets `done` at EOS everywhere or
        max_tokens."""
        engine, sampling = self.engine, self.sampling
        for _ in range(sampling.max_tokens if tokens is None else tokens):
            if self.done:
                return
            t, done = self.t, self.done_rows
            tok, logp = sample_next(self.logits, sampling, self.generator, self.share_rows)
            tok = torch.where(done, engine.pad_id, tok)
            self.tokens_out[:, t] = tok
            self.logps_out[:, t] = torch.where(done, 0.0, logp)
            hit = ~done & torch.isin(tok, self.eos) if not sampling.ignore_eos else torch.zeros_like(done)
            self.lengths = torch.where(hit, t + 1, self.lengths)
            done |= hit
            self.t = t + 1
            if bool(done.all()) or t == sampling.max_tokens - 1:
                self.done = True
                # the memory goes back before the results are read
                self.cache = self.logits = self.prompt_cache = None
                return
            self.logits = self._forward(tok, done)
            self.next_pos = self.next_pos + 1

    def _forward(self, tok: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        engine = self.engine
        inputs = dict(
            input_ids=tok[:, None], position_ids=self.next_pos[:, None], use_cache=True,
            **{engine._cache_kw: self.cache},
        )  # fmt: skip
        if self.prompt_cache is None:
            self.mask = torch.cat([self.mask, (~done).long()[:, None]], dim=1)
            return engine.model(attention_mask=self.mask, **inputs).logits[:, -1]
        # a finished row's later tokens are never read, so its own tokens need no mask
        if self.written_out:
            return decode_step.decode_logits(engine.model, tok, self.next_pos, self.cache, self._attend)
        with shared_prompt.decoding_attention(engine.model):
            return engine.model(prompt_cache=self.prompt_cache, **inputs).logits[:, -1]

    def _attend(self, module, query, keys, values) -> torch.Tensor:
        # what the model's attention module would call through the interface `decoding_attention` sets
        return shared_prompt.shared_prompt_attention(
            module, query, keys, values, None, scaling=module.scaling, prompt_cache=self.prompt_cache
        )[0]

    def stop_rows(self, start: int, end: int) -> None:
        """Decode no more tokens for rows [start, end) (their caller went away); the rest go on."""
        self.done_rows[start:end] = True

    def results(self) -> list[list[Completion]]:
        """`n` completions per prompt, in prompt order (call once `done`)."""
        engine = self.engine
        tokens_cpu, logps_cpu, lengths_cpu = self.tokens_out.cpu(), self.logps_out.cpu(), self.lengths.cpu()
        eos_set = set(engine.eos.tolist())
        results: list[list[Completion]] = []
        for p in range(self.num_prompts):
            group = []
            for j in range(self.n):
                row = p * self.n + j
                k = int(lengths_cpu[row])
                ids_row = tokens_cpu[row, :k].tolist()
                stopped = ids_row and ids_row[-1] in eos_set and not self.sampling.ignore_eos
                reason = "stop" if stopped else "length"
                text = engine.tokenizer.decode(ids_row, skip_special_tokens=True)
                group.append(Completion(ids_row, logps_cpu[row, :k].tolist(), reason, engine.version, text))
            results.append(group)
        return results


def own_tokens_cache(config, prompt: shared_prompt.PromptCache, rows: int, limit: int):
    """An empty DynamicCache for the decoded tokens of `rows` completions (their prompts' keys and values
    are in `prompt`), each layer in reserved buffers (`reserved_layer_class`) for up to `limit` tokens."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    reserved = reserved_layer_class()
    room = max(1, min(limit, 64))
    for i, keys in enumerate(prompt.keys):
        shape = (rows, keys.shape[1], room, keys.shape[3])
        cache.layers[i] = reserved(keys.new_empty(shape), keys.new_empty(shape), max(limit, 1), filled=0)
    return cache


def reserve_room(cache, limit: int) -> None:
    """Give each full-attention layer of `cache` (a DynamicCache after its prefill) buffers with room for the
    tokens still to come, up to `limit` in all (`reserved_layer_class`). Other layer kinds are left as they
    are."""
    from transformers.cache_utils import DynamicLayer

    reserved = reserved_layer_class()
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel():
            cache.layers[i] = reserved(layer.keys, layer.values, limit)


@functools.cache
def reserved_layer_class():
    # built on first use: this module imports transformers only when a generation starts
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):
        """A full-attention KV cache layer whose keys and values live in buffers with room for more tokens:
        a decoded token is written in place, where DynamicLayer concatenates a new copy of the whole cache
        at every token, copying quadratically in the generation's length (32 sequences of 256 tokens took
        0.81x the time in place, the tiny recipe's 24 tokens 0.95x). The room doubles when full, up to
        `limit` tokens, so a long generation does not reserve its whole length up front. `keys` and
        `values` are views of the filled part, as DynamicLayer's tensors are read."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, limit: int, filled: int | None = None):
            super().__init__()
            self.device, self.dtype, self.limit = keys.device, keys.dtype, limit
            self.is_initialized = True
            self._k, self._v = keys, values  # the buffers, of which the first `filled` positions are in use
            filled = keys.shape[-2] if filled is None else filled
            self.keys, self.values = keys[:, :, :filled], values[:, :, :filled]

        def update(self, key_states, value_states, *args, **kwargs):
            start = self.keys.shape[-2]  # the filled part: DynamicLayer's crop shortens this view
            end = start + key_states.shape[-2]
            if end > self._k.shape[-2]:
                room = max(end, min(self.limit, 2 * end))
                self._k, self._v = self._grown(self._k, start, room), self._grown(self._v, start, room)
            self._k[:, :, start:end] = key_states
            self._v[:, :, start:end] = value_states
            self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
            return self.keys, self.values

        @staticmethod
        def _grown(buffer: torch.Tensor, filled: int, room: int) -> torch.Tensor:
            b, h, _, d = buffer.shape
            grown = buffer.new_empty((b, h, room, d))
            grown[:, :, :filled] = buffer[:, :, :filled]
            return grown

        # the batch-reshaping methods make new tensors of the filled part, which become the buffers
        def batch_repeat_interleave(self, repeats: int) -> None:
            super().batch_repeat_interleave(repeats)
            self._k, self._v = self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            super().batch_select_indices(indices)
            self._k, self._v = self.keys, self.values

    return ReservedLayer


def _eos_ids(model, tokenizer) -> list[int]:
    ids = (
        getattr(model.generation_config, "eos_token_id", None)
        if hasattr(model, "generation_config")
        else None
    )
    if ids is None:
        ids = tokenizer.eos_token_id
    return [ids] if isinstance(ids, int) else list(ids)
