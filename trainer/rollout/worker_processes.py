"""Rollout engines in their own processes, fed by the trainer: the asynchronous half of GRPO.

The trainer (rank 0) and each rollout worker (ranks 1..N) share a dedicated process group used only for weight
sync: NCCL, GPU to GPU, when the trainer and every worker compute on GPUs, else gloo through host memory
(`weight_sync.choose_transport`); workers on the trainer's CPU that hold a module of their own (the
transformers engine) read the weights out of a shared-memory block instead (`weight_sync.SharedWeights`), the
group then serving only to start them. Requests and results travel over multiprocessing queues. A worker
handles one command at a time, so a weight sync always lands between two generations: a generation never sees
weights change in its middle. Every wait is bounded by `sync_timeout_s`, and a worker that dies makes the
trainer fail with a message naming it instead of hanging.

Prompts of one batch are sharded across the workers (data-parallel engines) and the results are put
back in prompt order.

Each worker is started with its engine's CUDA_VISIBLE_DEVICES (`trainer.placement`) and computes on its
ordinal 0, where vLLM's single-process executor looks; torchrun's rank variables are not passed on (a worker
is no trainer rank). The transformers engine generates with the worker's own module, which the weights are
received into. vLLM and LMDeploy hold their own copy: the worker keeps none, and hands the buckets to the
engine as they arrive (`weight_sync.receive_stream`), on its GPU under NCCL (as vLLM's NCCL weight-transfer
engine and TRL's vLLM client do), so no host copy of the model is made at each sync; vLLM measures the GPU's
free memory when it starts, before any of them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.multiprocessing as mp

from trainer.launch import free_port
from trainer.recipe import ModelConfig, RolloutConfig
from trainer.rollout.base import SamplingParams, contiguous_shares

log = logging.getLogger(__name__)


class RolloutWorkerError(RuntimeError):
    """A rollout worker died, timed out or failed; the message names it."""


@dataclass(frozen=True)
class WeightSync:
    """One weight sync as the trainer saw it: its wall time and the bytes it broadcast (once for all
    workers)."""

    seconds: float
    bytes: int


@dataclass(kw_only=True)
class WorkerSpec:
    """What one rollout worker process is started with (pickled to the spawned process)."""

    rank: int
    world_size: int
    port: int
    model_path: str
    model_cfg: ModelConfig  # the recipe's, whole: dtype, modality, remote code, attention implementation
    device: str
    threads: int
    timeout_s: float
    version: int = 0  # the policy version of the weights it loads (a resumed run's step)
    rollout: RolloutConfig | None = None  # which engine to build, and its settings (None: transformers)
    max_model_len: int | None = None
    seed: int = 0
    cuda_visible_devices: str | None = None  # what the worker is started with (None: the trainer's)
    backend: str = "gloo"  # of the sync group, the same for all its members (`choose_transport`)
    sync_device: str = "cpu"  # where this worker receives the weights (`choose_transport`)


# torchrun's variables for its own ranks: a rollout worker is not one (vLLM would read them as its own)
LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)
_SPAWN_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def worker_environment(cuda_visible_devices: str | None) -> Iterator[None]:
    """This process's environment as a spawned worker should inherit it, for the duration of the block:
    its own CUDA_VISIBLE_DEVICES (when given), none of torchrun's rank variables. Restored afterwards."""
    changes = {name: None for name in LAUNCHER_VARS}
    if cuda_visible_devices is not None:
        changes["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    with _SPAWN_ENV_LOCK:
        saved = {name: os.environ.get(name) for name in changes}
        try:
            _set_environment(changes)
            yield
        finally:
            _set_environment(saved)


def _set_environment(values: dict[str, str | None]) -> None:
    """Set each variable to its value; None unsets it."""
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _worker_main(spec: WorkerSpec, commands, results) -> None:
    """A rollout worker: build its engine, then serve 'sync' / 'generate' / 'weights' / 'stop' commands.

    The transformers engine generates with the very module the weights are received into. vLLM and LMDeploy
    hold their own copy: the received weights are handed to the engine's own update path as they arrive."""
    from trainer.model_loading import load_model
    from trainer.rollout.engines import load_policy, make_engine
    from trainer.rollout.weight_sync import SyncGroup, receive_stream, receive_weights, sync_order

    torch.set_num_threads(spec.threads)
    try:
        if spec.backend == "nccl":  # NCCL binds this process to the device it is current on
            torch.cuda.set_device(spec.sync_device)
        group = SyncGroup("127.0.0.1", spec.port, spec.rank, spec.world_size, spec.timeout_s, spec.backend)
        rollout = spec.rollout or RolloutConfig()
        model = tokenizer = None
        if rollout.engine == "transformers":  # the trainer verified this checkpoint before it started us
            model, tokenizer = load_model(spec.model_path, spec.model_cfg, spec.device, verify=False)
            model.eval()
        engine = make_engine(
            rollout,
            spec.model_path,
            model=model,
            tokenizer=tokenizer,
            device=spec.device,
            model_cfg=spec.model_cfg,
            seed=spec.seed,
            max_model_len=spec.max_model_len,
        )
        engine.version = spec.version
        shared = None  # the shared-memory block of the weight syncs, once the first sync brings it
        results.put(("ready", spec.rank, None))
        parent = os.getppid()
        while True:
            try:
                kind, payload = commands.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:  # the trainer is gone (even by SIGKILL): do not linger
                    break
                continue
            if kind == "stop":
                break
            if kind == "sync":
                version, layout, via = payload
                started = time.perf_counter()
                if model is None:  # the engine holds its own copy: the buckets go to it as they arrive
                    stream = receive_stream(layout, group, spec.sync_device)
                    _stream_to_engine(engine, stream, spec.device, version)
                else:
                    if via is not None:  # the trainer wrote the weights into shared memory before telling us
                        shared = shared if via == "shared" else via
                        shared.read_into(sync_order(model))
                    else:
                        receive_weights(sync_order(model), group, device=spec.sync_device)
                    load_policy(engine, model, version)
                results.put(("synced", spec.rank, time.perf_counter() - started))
            elif kind == "generate":
                step, prompts, n, sampling = payload
                started = time.perf_counter()
                out = engine.generate(prompts, n, sampling)
                results.put(("generated", spec.rank, (step, out, time.perf_counter() - started)))
            elif kind == "weights":  # for checks: the worker's weights as it holds them
                if model is None:
                    raise RuntimeError(f"the {rollout.engine} engine's worker keeps no module to read back")
                results.put(
                    ("weights", spec.rank, {n: t.detach().cpu().clone() for n, t in sync_order(model)})
                )
        if model is not None:  # the transformers engine: nothing outside this process to shut down
            _exit_now(results)
    except Exception:  # noqa: BLE001 - reported to the trainer, which fails with it
        results.put(("error", spec.rank, traceback.format_exc()))


def _exit_now(results) -> None:
    """End this worker once what it sent is through, without the interpreter's teardown of torch and
    transformers (~0.9 s of one core, measured on the tiny model's worker: the trainer waits for it)."""
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _stream_to_engine(engine, stream: Iterator[tuple[str, torch.Tensor]], device: str, version: int) -> None:
    """Hand the received tensors to an engine with a copy of its own, on its `device` (LMDeploy loads from
    CUDA tensors alone, also when gloo brought them through host memory), then take what it left unread:
    each bucket is a collective the trainer waits on, and a tensor the engine skipped would stay stale."""
    engine.update_weights(((name, t.to(device)) for name, t in stream), version)
    unread = [name for name, _ in stream]
    if unread:
        raise RuntimeError(
            f"the engine took the weight sync without reading {len(unread)} tensors: {unread[:3]}"
        )


# what the trainer waits for when it expects each kind of answer (named when it does not come)
_AWAITED = {"ready": "its engine to start", "synced": "a weight sync to be applied", "weights": "its weights"}


class RolloutWorkers:
    """Trainer-side handle on N rollout worker processes (ranks 1..N of the sync group)."""

    def __init__(
        self,
        model_path: str,
        *,
        model_cfg: ModelConfig | None = None,
        devices: list[str] | None = None,
        num_engines: int = 1,
        timeout_s: float = 600.0,
        threads_per_worker: int = 1,
        version: int = 0,
        rollout: RolloutConfig | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        cuda_visible_devices: list[str | None] | None = None,
        trainer_device: str = "cpu",
        wait: bool = True,
    ):
        """`model_cfg`: the recipe's model settings (`ModelConfig()`'s defaults when None). `devices[k]` is
        worker k+1's device as it sees it, started with `cuda_visible_devices[k]` (None: the trainer's own;
        see `trainer.placement`). `trainer_device`: where the weights `sync_weights` sends are. `wait`: return
        once every worker is ready; False: once they are started, `wait_ready` to follow."""
        from trainer.extras import require_extra
        from trainer.rollout.weight_sync import choose_transport

        engine = (rollout or RolloutConfig()).engine
        if engine != "transformers":  # a missing install is the user's to fix: said before any worker starts
            require_extra(engine, f"the {engine!r} rollout engine")
        self.timeout_s = timeout_s
        devices = devices or ["cpu"] * num_engines
        masks = cuda_visible_devices or [None] * len(devices)
        if len(masks) != len(devices):
            raise ValueError(f"{len(devices)} worker devices but {len(masks)} CUDA_VISIBLE_DEVICES values")
        world = len(devices) + 1
        port = free_port()
        self.transport = choose_transport([trainer_device, *devices])
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.commands, self.procs = [], []
        for rank, (device, mask) in enumerate(zip(devices, masks, strict=True), start=1):
            q = ctx.Queue()
            spec = WorkerSpec(
                rank=rank,
                world_size=world,
                port=port,
                model_path=model_path,
                model_cfg=model_cfg or ModelConfig(),
                device=device,
                threads=threads_per_worker,
                timeout_s=timeout_s,
                version=version,
                rollout=rollout,
                max_model_len=max_model_len,
                seed=seed,
                cuda_visible_devices=mask,
                backend=self.transport.backend,
                sync_device=self.transport.devices[rank],
            )
            p = ctx.Process(
                target=_worker_main, args=(spec, q, self.results), name=f"rollout-worker-{rank}", daemon=True
            )
            with worker_environment(mask):  # a spawned child starts with the environment of this moment
                p.start()
            self.commands.append(q)
            self.procs.append(p)
        self._pending: dict[int, dict] = {}
        # workers on this CPU that hold a module of their own read the weights out of shared memory (made at
        # the first sync, when the policy's layout is known); the others take gloo's broadcast
        self._share_memory = (
            self.transport.backend == "gloo" and engine == "transformers" and all(d == "cpu" for d in devices)
        )
        self._shared = None
        # workers still to apply a shared-memory sync (their "synced" not yet in): the block is written again
        # only once they have read it
        self._applying: set[int] = set()
        self.busy_s = 0.0
        self._port, self._world, self.group = port, world, None
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Form the weight-sync group with the workers and wait until each has its engine up (the workers
        start meanwhile: `wait=False` lets the caller do other work first). On failure no worker is left."""
        from trainer.rollout.weight_sync import SyncGroup, WeightSyncError

        try:
            try:
                self.group = SyncGroup(
                    "127.0.0.1",
                    self._port,
                    0,
                    self._world,
                    self.timeout_s,
                    self.transport.backend,
                    self._check_alive,
                )
            except WeightSyncError as e:
                raise self._named_failure("forming the weight-sync group", e) from e
            except RolloutWorkerError as dead:  # one died before it joined: no need to wait out the timeout
                raise RolloutWorkerError(f"{dead} during forming the weight-sync group") from None
            self._expect("ready", self.ranks)
        except BaseException:  # no worker outlives a start that failed
            self.close()
            raise

    # ---------------------------------------------------------------------------------------- plumbing
    @property
    def ranks(self) -> list[int]:
        return list(range(1, len(self.procs) + 1))

    def _name(self, rank: int) -> str:
        p = self.procs[rank - 1]
        return f"rollout worker {rank} (pid {p.pid})"

    def _names(self, ranks: list[int]) -> str:
        return ", ".join(self._name(rank) for rank in ranks)

    def _check_alive(self, grace_s: float = 0.0) -> None:
        deadline = time.monotonic() + grace_s
        while True:
            for rank, p in enumerate(self.procs, start=1):
                if not p.is_alive():
                    raise RolloutWorkerError(f"{self._name(rank)} died with exit code {p.exitcode}")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _named_failure(self, what: str, error: Exception) -> RolloutWorkerError:
        """A collective failed (gloo/NCCL say only 'connection closed' or 'timed out'): name the worker that
        died, if one did, else the workers it was with (one of them stalled, or the network between)."""
        try:
            self._check_alive(grace_s=2.0)
        except RolloutWorkerError as dead:
            return RolloutWorkerError(f"{dead} during {what}")
        return RolloutWorkerError(
            f"{what} with {self._names(self.ranks)} failed: {type(error).__name__}: {error}"
        )

    def _get(self, what: str, waiting: list[int]):
        """The next answer from any worker; `waiting`: the ranks whose answer is still due, named if none
        comes within the timeout (alive, yet silent: stopped, deadlocked, or slower than the timeout)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                kind, rank, payload = self.results.get(timeout=0.5)
            except queue.Empty:
                self._check_alive()
                if time.monotonic() > deadline:
                    raise RolloutWorkerError(
                        f"{self._names(waiting)} sent nothing within rollout.sync_timeout_s="
                        f"{self.timeout_s:g} s while the trainer waited for {what}: alive but stalled "
                        "(stopped, deadlocked, swapping), or slower than that timeout allows"
                    ) from None
                continue
            if kind == "error":
                raise RolloutWorkerError(f"{self._name(rank)} failed:\n{payload}")
            return kind, rank, payload

    def _next(self, what: str, waiting: list[int]) -> tuple | None:
        """The next answer, unless it is one kept here: a generated batch (for `collect`) or the "synced" of
        a shared-memory sync (`_applying`); then None."""
        kind, rank, payload = self._get(what, waiting)
        if kind == "generated":
            self._stash(rank, payload)
            return None
        if kind == "synced" and rank in self._applying:
            self._applying.discard(rank)
            return None
        return kind, rank, payload

    def _expect(self, kind_wanted: str, ranks: list[int]) -> dict[int, object]:
        """The `kind_wanted` answer of each of `ranks`, by rank; generated batches and shared-memory syncs'
        answers that arrive meanwhile are kept."""
        answers = {}
        while len(answers) < len(ranks):
            waiting = [rank for rank in ranks if rank not in answers]
            answer = self._next(_AWAITED[kind_wanted], waiting)
            if answer is None:
                continue
            kind, rank, payload = answer
            if kind != kind_wanted or rank not in waiting:
                raise RolloutWorkerError(
                    f"{self._name(rank)} answered {kind!r} while {kind_wanted!r} was expected"
                )
            answers[rank] = payload
        return answers

    def _await_applied(self) -> None:
        """Until every worker has read the shared block's last contents."""
        while self._applying:
            answer = self._next(_AWAITED["synced"], sorted(self._applying))
            if answer is not None:
                kind, rank, _ = answer
                raise RolloutWorkerError(f"{self._name(rank)} answered {kind!r} while 'synced' was expected")

    def _stash(self, rank: int, payload) -> None:
        step, out, seconds = payload
        self._pending.setdefault(step, {})[rank] = out
        self.busy_s += seconds

    # -------------------------------------------------------------------------------------------- API
    def submit(self, step: int, prompts: list[list[int]], n: int, sampling: SamplingParams) -> None:
        """Start generating batch `step`; prompts are sharded across workers in contiguous slices, shard k
        sampled with `shard_seed(sampling.seed, k)` (one seed for all would give two copies of one prompt in
        two shards the same completions)."""
        self._check_alive()
        commands = self._generate_commands(step, prompts, n, sampling)
        for q, command in zip(self.commands, commands, strict=True):
            q.put(command)

    def _generate_commands(
        self, step: int, prompts: list[list[int]], n: int, sampling: SamplingParams
    ) -> list[tuple]:
        """Each worker's "generate" command for its shard of batch `step`."""
        shares = contiguous_shares(len(prompts), len(self.procs))
        return [
            ("generate", (step, prompts[lo:hi], n, replace(sampling, seed=shard_seed(sampling.seed, k))))
            for k, (lo, hi) in enumerate(shares)
        ]

    def collect(self, step: int) -> list:
        """The groups of batch `step`, in prompt order (blocks until every shard is back)."""
        while len(self._pending.get(step, {})) < len(self.procs):
            waiting = [rank for rank in self.ranks if rank not in self._pending.get(step, {})]
            answer = self._next(f"batch {step}", waiting)
            if answer is not None:
                kind, rank, _ = answer
                raise RolloutWorkerError(
                    f"{self._name(rank)} answered {kind!r} while generating batch {step}"
                )
        parts = self._pending.pop(step)
        return [g for rank in sorted(parts) for g in parts[rank]]

    def sync_weights(self, model, version: int, then: tuple | None = None) -> WeightSync:
        """Send the trainer's weights to every worker; each applies them between two generations.

        `then`: a batch (step, prompts, n, sampling, as `submit` takes them) to generate with these weights,
        queued behind the sync: each worker starts it as soon as the weights are in, not a round trip to the
        trainer later. Through shared memory this returns once the weights are written and the commands
        queued, so a worker may still be generating (`syncs_while_generating`): it reads them when that
        generation ends, and the next sync waits for that before it writes again. Gloo's or NCCL's broadcast
        returns once every worker has applied them."""
        from trainer.rollout.weight_sync import broadcast_weights, sync_layout, sync_tensors

        self._check_alive()
        started = time.perf_counter()
        layout = sync_layout(model)  # for workers without a module of their own to receive into
        first = self._shared is None  # the block itself travels with the first sync, its name after
        shared = self._shared_block(layout)
        via = None
        if shared is not None:  # written before any worker is told to read
            self._await_applied()
            sent = shared.write(sync_tensors(model))
            via = shared if first else "shared"
        following = self._generate_commands(*then) if then is not None else [None] * len(self.commands)
        for q, command in zip(self.commands, following, strict=True):
            q.put(("sync", (version, layout, via)))
            if command is not None:
                q.put(command)
        if shared is None:
            device = self.transport.devices[0]
            named = ((name, t.detach().to(device)) for name, t in sync_tensors(model))  # gloo: host memory
            try:
                sent = broadcast_weights(named, self.group)
            except RuntimeError as e:
                raise self._named_failure(f"the weight sync to version {version}", e) from e
            self._expect("synced", self.ranks)
        else:
            self._applying = set(self.ranks)
        return WeightSync(time.perf_counter() - started, sent)

    @property
    def syncs_while_generating(self) -> bool:
        """Whether a sync can be sent while the workers generate, without waiting for them: through shared
        memory the trainer writes and each worker reads when it is free; a broadcast is a collective that
        every worker must join."""
        return self._share_memory

    def _shared_block(self, layout):
        """The shared-memory block the weights travel in, made at the first sync; None where the workers
        take gloo's broadcast (another device or engine, or no room in /dev/shm, which is then logged)."""
        from trainer.rollout.weight_sync import SharedWeights

        if self._shared is None and self._share_memory:
            need = SharedWeights.placement(layout)[1]
            try:
                free = shutil.disk_usage("/dev/shm").free
                if free < 2 * need:
                    raise OSError(f"/dev/shm has {free} bytes free, the weights take {need}")
                self._shared = SharedWeights(layout)
            except (OSError, RuntimeError) as e:
                log.warning("weight sync through shared memory unavailable (%s): gloo's broadcast instead", e)
                self._share_memory = False
        return self._shared

    def worker_weights(self, rank: int = 1) -> dict[str, torch.Tensor]:
        self.commands[rank - 1].put(("weights", None))
        return self._expect("weights", [rank])[rank]

    def close(self) -> None:
        for q, p in zip(self.commands, self.procs, strict=True):
            if p.is_alive():
                q.put(("stop", None))
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def shard_seed(seed: int | None, shard: int) -> int | None:
    """The sampling seed of shard `shard`: the batch's own for the first (one worker samples as before), the
    others moved by multiples of 2**32, beyond any step's seed."""
    return None if seed is None else seed + (shard << 32)


def cpu_threads_per_side(num_workers: int) -> int:
    """Cores split evenly between the trainer and the workers (at least one each)."""
    return max(1, (os.cpu_count() or 2) // (num_workers + 1))
