"""LMDeploy rollout engine: the executor it is built with, and where its sleep / wake-up calls run.

LMDeploy has no CPU backend, so it cannot run here. The plain functions (`engine_config`, `call_on_loop`) are
tested directly; wherever a test needs LMDeploy's own classes it uses fakes modelled on LMDeploy 0.18's source
(`PytorchEngineConfig`, `AsyncEngine.sleep` / `wakeup`, `EngineLoop.resume_from_sleep`), and says so in its
name. The real engine is exercised by `infra/gpu/smoke.sh` on a GPU machine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import types

import pytest

import trainer.rollout.lmdeploy_engine as lmdeploy_engine
from trainer.rollout.lmdeploy_engine import LMDeployEngine, call_on_loop, engine_config


@dataclasses.dataclass
class FakePytorchEngineConfig:
    """The fields of LMDeploy 0.18's `PytorchEngineConfig` that grpoflow sets, with LMDeploy's defaults."""

    dtype: str = "auto"
    tp: int = 1
    session_len: int | None = None
    max_batch_size: int | None = None
    cache_max_entry_count: float = 0.8
    distributed_executor_backend: str | None = None  # None: LMDeploy picks "uni" for tp = 1
    logprobs_mode: str | None = None


def fake_config_without(name: str, *dropped: str):
    """A fake LMDeploy config class: FakePytorchEngineConfig's fields less `dropped`."""
    return dataclasses.make_dataclass(
        name,
        [
            (f.name, f.type, dataclasses.field(default=f.default))
            for f in dataclasses.fields(FakePytorchEngineConfig)
            if f.name not in dropped
        ],
    )


# LMDeploy 0.9's PytorchEngineConfig had no logprobs_mode yet
FakeOldPytorchEngineConfig = fake_config_without("FakeOldPytorchEngineConfig", "logprobs_mode")
# LMDeploy 0.18's TurbomindEngineConfig, as far as grpoflow sets it: no executor choice, no log-prob mode
FakeTurbomindEngineConfig = fake_config_without(
    "FakeTurbomindEngineConfig", "distributed_executor_backend", "logprobs_mode"
)


def test_pytorch_config_picks_the_ray_executor_fake_lmdeploy_config():
    """Fake LMDeploy config class: tp = 1 must not leave the executor to LMDeploy (it would pick "uni",
    whose update_params raises NotImplementedError); every other setting is passed through."""
    config = engine_config(
        FakePytorchEngineConfig,
        "pytorch",
        tensor_parallel_size=1,
        gpu_memory_utilization=0.2,
        dtype="bfloat16",
        session_len=1024,
    )
    assert config == FakePytorchEngineConfig(
        dtype="bfloat16",
        tp=1,
        session_len=1024,
        cache_max_entry_count=0.2,
        distributed_executor_backend="ray",
        logprobs_mode="raw_logprobs",
    )
    config = engine_config(FakePytorchEngineConfig, "pytorch", tensor_parallel_size=2, max_batch_size=32)
    assert (config.tp, config.distributed_executor_backend, config.max_batch_size) == (2, "ray", 32)
    assert config.session_len is None and config.cache_max_entry_count == 0.8


def test_executor_without_update_params_is_refused_fake_lmdeploy_config():
    """Fake LMDeploy config class: asking for "uni" or "mp" is an error naming why; "ray" is accepted."""
    for executor in ("uni", "mp"):
        with pytest.raises(ValueError, match=rf"distributed_executor_backend='{executor}'.*update_params"):
            engine_config(FakePytorchEngineConfig, "pytorch", distributed_executor_backend=executor)
    config = engine_config(FakePytorchEngineConfig, "pytorch", distributed_executor_backend="ray")
    assert config.distributed_executor_backend == "ray"


def test_old_lmdeploy_and_turbomind_configs_fake_lmdeploy_config():
    """Fake LMDeploy config classes: an LMDeploy without logprobs_mode is refused with its version; TurboMind
    (no executor field, no update_params path) gets only the common settings."""
    with pytest.raises(
        RuntimeError, match=r"LMDeploy 0\.9\.2's PyTorch engine has no logprobs_mode.*>= 0\.11"
    ):
        engine_config(FakeOldPytorchEngineConfig, "pytorch", version="0.9.2")
    config = engine_config(
        FakeTurbomindEngineConfig, "turbomind", tensor_parallel_size=2, gpu_memory_utilization=0.5
    )
    assert config == FakeTurbomindEngineConfig(
        dtype="auto", tp=2, session_len=None, cache_max_entry_count=0.5
    )


class LoopThread:
    """An asyncio loop running in its own thread, as LMDeploy's `_EventLoopThread`; debug mode makes asyncio
    raise when a loop-owned object (a future, an Event's waiter) is touched from another thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.loop.set_debug(True)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


def test_call_on_loop_runs_plain_and_async_functions_on_the_loop_thread(loop_thread):
    async def async_ident(offset):
        await asyncio.sleep(0)
        return threading.get_ident() + offset

    assert call_on_loop(loop_thread.loop, threading.get_ident, timeout_s=10) == loop_thread.thread.ident
    assert call_on_loop(loop_thread.loop, async_ident, 3, timeout_s=10) == loop_thread.thread.ident + 3
    assert loop_thread.thread.ident != threading.get_ident()

    def fails(tag):
        raise KeyError(tag)

    with pytest.raises(KeyError, match="kv_cache"):
        call_on_loop(loop_thread.loop, fails, "kv_cache", timeout_s=10)

    async def from_the_loop_itself():
        return call_on_loop(loop_thread.loop, threading.get_ident, timeout_s=1)

    with pytest.raises(RuntimeError, match="its own event loop"):
        asyncio.run_coroutine_threadsafe(from_the_loop_itself(), loop_thread.loop).result(10)


class FakeAsyncEngine:
    """Fake of LMDeploy 0.18's `AsyncEngine` over the PyTorch engine, as far as sleep / wakeup go: `sleep` is
    a coroutine, `wakeup` a plain method that, once every tag is awake, sets the engine loop's resume
    `asyncio.Event` (`EngineLoop.resume_from_sleep`), which a task on the pipeline's loop waits on."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.sleeping_tags: set[str] = set()
        self.wakeup_threads: list[int] = []
        self.resumed = 0
        self.resume = asyncio.run_coroutine_threadsafe(self._make_event(), loop).result(10)

    async def _make_event(self):
        return asyncio.Event()

    async def _engine_loop(self):
        await self.resume.wait()  # what LMDeploy's engine loop does while asleep
        self.resumed += 1

    async def sleep(self, level: int = 1):
        self.sleeping_tags = {"weights", "kv_cache"}
        self.resume.clear()
        asyncio.get_running_loop().create_task(self._engine_loop())

    def wakeup(self, tags=None):
        self.wakeup_threads.append(threading.get_ident())
        self.sleeping_tags -= set(tags or self.sleeping_tags)
        if not self.sleeping_tags:
            self.resume.set()


def fake_lmdeploy_module(loop_thread: LoopThread, built: list):
    """A fake `lmdeploy` module: the config classes above, a GenerationConfig with the fields grpoflow checks,
    and a `pipeline()` that records its backend config and returns a pipeline on `loop_thread`."""

    @dataclasses.dataclass
    class GenerationConfig:
        n: int = 1
        include_stop_str_in_output: bool = False

    def pipeline(model_path, backend_config, log_level):
        built.append(backend_config)
        return types.SimpleNamespace(
            async_engine=FakeAsyncEngine(loop_thread.loop),
            internal_thread=types.SimpleNamespace(loop=loop_thread.loop),
        )

    return types.SimpleNamespace(
        __version__="0.18.0",
        PytorchEngineConfig=FakePytorchEngineConfig,
        TurbomindEngineConfig=FakeTurbomindEngineConfig,
        GenerationConfig=GenerationConfig,
        pipeline=pipeline,
    )


def test_engine_on_fake_lmdeploy_uses_ray_and_wakes_up_on_its_loop(loop_thread, monkeypatch):
    """Fake LMDeploy module: the engine is built with the Ray executor, and the trainer's sequence around a
    weight sync (sleep(1), wake_up(["weights"]), wake_up(["kv_cache"])) runs `wakeup` on LMDeploy's loop, so
    the waiting engine loop resumes. Called from the trainer's thread instead, setting the
    Event fails with asyncio's "Non-thread-safe operation" error."""
    built = []
    monkeypatch.setattr(
        lmdeploy_engine, "import_extra", lambda module, what: fake_lmdeploy_module(loop_thread, built)
    )
    engine = LMDeployEngine(
        "/models/tiny", gpu_memory_utilization=0.2, dtype="bfloat16", session_len=1024, timeout_s=10
    )
    assert [
        (c.distributed_executor_backend, c.logprobs_mode, c.tp, c.cache_max_entry_count) for c in built
    ] == [("ray", "raw_logprobs", 1, 0.2)]
    fake = engine.pipe.async_engine

    engine.sleep(1)
    assert engine._asleep == {"weights", "kv_cache"} and fake.sleeping_tags == {"weights", "kv_cache"}
    engine.wake_up(["weights"])
    assert engine._asleep == {"kv_cache"} and fake.resumed == 0
    engine.wake_up(["kv_cache"])
    assert engine._asleep == set()
    call_on_loop(loop_thread.loop, asyncio.sleep, 0, timeout_s=10)  # let the resumed engine loop run
    assert fake.resumed == 1
    assert fake.wakeup_threads == [loop_thread.thread.ident] * 2
