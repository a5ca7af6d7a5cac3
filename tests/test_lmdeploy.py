"""LMDeploy rollout engine: the executor it is built with, the settings it passes, where its sleep / wake-up
calls run, and the names it uses checked against LMDeploy's own source.

LMDeploy has no CPU backend, so it cannot run here. The plain functions (`engine_config`,
`generation_config`, `call_on_loop`) are tested directly; wherever a test needs LMDeploy's objects at work it
uses fakes modelled on LMDeploy 0.18's source (`PytorchEngineConfig`, `AsyncEngine.sleep` / `wakeup`,
`EngineLoop.resume_from_sleep`), and says so in its name. The names the engine uses (config fields, call
parameters, the weight-update path) are checked against LMDeploy's real source, read from its oldest and
newest supported wheels. The real engine is exercised by `infra/gpu/smoke.sh` on a GPU machine.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import threading
import types
from pathlib import Path

import pytest

import trainer.rollout.lmdeploy_engine as lmdeploy_engine
from conftest import REPO_ROOT
from trainer.rollout.lmdeploy_engine import LMDeployEngine, call_on_loop, engine_config, generation_config


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


# ---- grpoflow's calls against LMDeploy's own source -------------------------------------------------------
# LMDeploy's package does not import here (no CUDA, and dependencies its extra brings, such as mmengine), so
# its classes are read from its published wheels' Python source with `ast`: the oldest and the newest release
# the `lmdeploy` extra allows, each downloaded once into .state/cache (about 100 MB; the compiled TurboMind
# library stays in the wheel). Every field name and call grpoflow makes must be there.

# the wheels of both ends (0.11 was built for manylinux2014, later releases for manylinux_2_28)
WHEEL_TAGS = (
    *(
        "--python-version",
        "3.11",
        "--platform",
        "manylinux_2_28_x86_64",
        "--platform",
        "manylinux2014_x86_64",
    ),
)


def lmdeploy_requirements() -> dict[str, str]:
    """{"oldest": "lmdeploy==<lower bound>", "newest": "<the extra's requirement>"} from pyproject.toml."""
    import tomllib
    from packaging.requirements import Requirement

    extra = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (requirement,) = extra["lmdeploy"]
    (lower,) = [s.version for s in Requirement(requirement).specifier if s.operator == ">="]
    return {"oldest": f"lmdeploy=={lower}", "newest": requirement}


@pytest.fixture(scope="module", params=["oldest", "newest"])
def lmdeploy_source(request) -> tuple[str, Path]:
    """(version, the directory holding its `lmdeploy/` Python files) for one end of the supported range."""
    import hashlib
    import shutil
    import subprocess
    import sys
    import tempfile
    import zipfile

    requirement = lmdeploy_requirements()[request.param]
    cache = REPO_ROOT / ".state" / "cache" / "lmdeploy-source"
    slug = hashlib.sha256(requirement.encode()).hexdigest()[:12]
    done = [d for d in cache.glob(f"{slug}-*") if (d / "lmdeploy" / "__init__.py").is_file()]
    if done:
        return done[0].name.split("-", 1)[1], done[0]
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             *WHEEL_TAGS, "-d", tmp, requirement],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert proc.returncode == 0, f"pip download {requirement}: {proc.stderr[-2000:]}"
        (wheel,) = Path(tmp).glob("lmdeploy-*.whl")
        version = wheel.name.split("-")[1]
        unpacked = Path(tmp) / "src"
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(
                unpacked, [n for n in zf.namelist() if n.startswith("lmdeploy/") and n.endswith(".py")]
            )
        target = cache / f"{slug}-{version}"
        try:
            unpacked.rename(target)
        except OSError:  # another worker unpacked the same release first
            shutil.rmtree(unpacked, ignore_errors=True)
    return version, target


class Source:
    """LMDeploy's modules as syntax trees: classes, their fields and their methods' parameters."""

    def __init__(self, root: Path):
        self.root = root

    def tree(self, module: str) -> ast.Module:
        return ast.parse((self.root / module).read_text())

    def cls(self, module: str, name: str) -> ast.ClassDef:
        found = [n for n in self.tree(module).body if isinstance(n, ast.ClassDef) and n.name == name]
        assert found, f"LMDeploy's {module} defines no class {name}"
        return found[0]

    def fields(self, module: str, name: str) -> set[str]:
        """A dataclass's or pydantic model's fields: its annotated class attributes."""
        body = self.cls(module, name).body
        return {n.target.id for n in body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}

    def methods(self, module: str, name: str) -> dict[str, list[str]]:
        """{method: its parameter names (self first)} of class `name`."""
        return {
            n.name: [a.arg for a in (*n.args.posonlyargs, *n.args.args, *n.args.kwonlyargs)]
            for n in self.cls(module, name).body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        }

    def function(self, module: str, name: str) -> list[str]:
        found = [
            n
            for n in self.tree(module).body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
        ]
        assert found, f"LMDeploy's {module} defines no function {name}"
        args = found[0].args
        return [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]

    def assigns_self(self, module: str, name: str, attribute: str) -> bool:
        return any(
            isinstance(n, ast.Attribute) and n.attr == attribute and isinstance(n.ctx, ast.Store)
            for n in ast.walk(self.cls(module, name))
        )

    def compared_to(self, module: str, constant: str) -> bool:
        """Whether code in `module` compares something to the string `constant` (not a docstring mention)."""
        return any(
            isinstance(n, ast.Compare)
            and any(isinstance(c, ast.Constant) and c.value == constant for c in (n.left, *n.comparators))
            for n in ast.walk(self.tree(module))
        )

    def find(self, *candidates: str) -> str:
        """The first of `candidates` (a module path per LMDeploy version) that exists."""
        for module in candidates:
            if (self.root / module).is_file():
                return module
        raise AssertionError(f"LMDeploy has none of {candidates}")


def real_config_class(src: Source, name: str):
    """A stand-in built from the real class's field names alone (any value accepted): passing it a field
    LMDeploy does not have raises TypeError, as the real dataclass would."""
    fields = sorted(src.fields("lmdeploy/messages.py", name))
    return dataclasses.make_dataclass(name, [(f, object, dataclasses.field(default=None)) for f in fields])


def test_engine_configs_use_lmdeploys_real_field_names(lmdeploy_source):
    version, root = lmdeploy_source
    src = Source(root)
    pytorch_cls = real_config_class(src, "PytorchEngineConfig")
    config = engine_config(
        pytorch_cls, "pytorch", tensor_parallel_size=2, gpu_memory_utilization=0.3, dtype="bfloat16",
        session_len=1024, version=version, max_batch_size=32,
    )  # fmt: skip
    assert (config.tp, config.cache_max_entry_count, config.dtype, config.session_len) == (
        2,
        0.3,
        "bfloat16",
        1024,
    )
    assert (config.distributed_executor_backend, config.logprobs_mode, config.max_batch_size) == (
        "ray", "raw_logprobs", 32
    )  # fmt: skip
    # the values grpoflow picks are ones LMDeploy acts on
    assert src.compared_to("lmdeploy/pytorch/engine/executor/__init__.py", "ray"), version
    assert src.compared_to("lmdeploy/pytorch/engine/logits_process.py", "raw_logprobs"), version
    turbomind = engine_config(
        real_config_class(src, "TurbomindEngineConfig"), "turbomind", tensor_parallel_size=2, session_len=512
    )
    assert (turbomind.tp, turbomind.session_len, turbomind.cache_max_entry_count) == (2, 512, 0.8)
    # the package exports what LMDeployEngine takes from it
    exported = {
        alias.asname or alias.name
        for n in ast.walk(src.tree("lmdeploy/__init__.py"))
        if isinstance(n, ast.ImportFrom)
        for alias in n.names
    }
    assert {
        "pipeline",
        "PytorchEngineConfig",
        "TurbomindEngineConfig",
        "GenerationConfig",
        "__version__",
    } <= (exported), version


def test_generation_config_fields_grpoflow_sets_exist_in_lmdeploy(lmdeploy_source):
    """`generation_config` leaves out the settings a release's GenerationConfig lacks: against the real
    field names, every setting it makes must arrive."""
    from trainer.rollout.base import SamplingParams

    version, root = lmdeploy_source
    gen_cls = real_config_class(Source(root), "GenerationConfig")
    sampled = generation_config(gen_cls, SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9), 5)
    expected = {
        "n": 1, "max_new_tokens": 7, "do_sample": True, "top_k": 0, "top_p": 0.9, "temperature": 0.7,
        "random_seed": 5, "logprobs": 1, "include_stop_str_in_output": True, "skip_special_tokens": True,
        "ignore_eos": False,
    }  # fmt: skip
    assert {k: getattr(sampled, k) for k in expected} == expected, version
    greedy = generation_config(gen_cls, SamplingParams(max_tokens=3, temperature=0.0), None)
    assert (greedy.do_sample, greedy.temperature, greedy.top_p) == (False, 1.0, 1.0), version


def test_engine_calls_match_lmdeploys_async_engine_and_weight_update(lmdeploy_source):
    version, root = lmdeploy_source
    src = Source(root)
    assert {"model_path", "backend_config", "log_level"} <= set(src.function("lmdeploy/api.py", "pipeline"))
    # token-id prompts: generate(messages=None, session_id, gen_config, input_ids=...) before 0.16, then
    # preprocess(... the same ...) and generate(request, stream_response=False)
    module = src.find("lmdeploy/serve/core/async_engine.py", "lmdeploy/serve/async_engine.py")
    methods = src.methods(module, "AsyncEngine")
    request_args = {"messages", "session_id", "gen_config", "input_ids"}
    if "preprocess" in methods:
        assert request_args <= set(methods["preprocess"]), (version, methods["preprocess"])
        assert methods["generate"][:2] == ["self", "request"] and "stream_response" in methods["generate"]
    else:
        assert request_args | {"stream_response"} <= set(methods["generate"]), (version, methods["generate"])
    assert methods["sleep"][1:] == ["level"] and methods["wakeup"][1:] == ["tags"], version
    if src.assigns_self(module, "AsyncEngine", "session_mgr"):  # else the engine numbers sessions itself
        managers = src.find("lmdeploy/serve/managers/session_manager.py", "lmdeploy/serve/managers.py")
        assert "get" in src.methods(managers, "SessionManager"), version
    assert src.assigns_self(module, "AsyncEngine", "engine"), version  # where update_params is called
    # what each streamed output carries
    assert {"token_ids", "logprobs", "response", "finish_reason"} <= src.fields(module, "GenOut"), version
    # the loop the engine lives on: the pipeline's (0.12+) or the async engine's own
    owner = (
        ("lmdeploy/pipeline.py", "Pipeline")
        if (root / "lmdeploy/pipeline.py").is_file()
        else (module, "AsyncEngine")
    )
    assert src.assigns_self(*owner, "internal_thread"), version
    assert src.assigns_self(owner[0], "_EventLoopThread", "loop"), version  # the thread beside it
    # in-place weights: UpdateParamsRequest through the engine to the Ray executor (the only one that has it)
    assert {"serialized_named_tensors", "finished"} <= src.fields(
        "lmdeploy/serve/openai/protocol.py", "UpdateParamsRequest"
    ), version
    assert src.function("lmdeploy/utils.py", "serialize_state_dict") == ["state_dict"], version
    assert "update_params" in src.methods("lmdeploy/pytorch/engine/engine.py", "Engine"), version
    ray = "lmdeploy/pytorch/engine/executor/ray_executor.py"
    assert "update_params" in src.methods(ray, "RayExecutor"), version
