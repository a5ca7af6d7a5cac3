"""Turning a reward spec from a recipe into a reward function.

A spec is one of
- a built-in name (`available_rewards()`): `format`, `accuracy`, `countdown`, `counting`, `cosine`, `repetition`,
  `soft_overlong`; `args` are the factory's parameters (`cosine`, `repetition`, `soft_overlong` take some, the
  others none);
- `package.module:function`: imported with importlib;
- `path/to/file.py:function`: loaded from that file (relative to `base_dir` when given, else to the working
  directory). This runs the file: it is code the user put in their recipe, like any import. Model text is
  never loaded or run anywhere in this package.

For a plug-in, `args` are bound to the function as keyword arguments (`functools.partial`), so a plug-in is the
reward function itself, with the TRL signature `f(prompts, completions, **columns)`.

Every failure raises RewardSpecError (a ValueError) naming the spec and what was expected.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType

from trainer.rewards.countdown import countdown_reward
from trainer.rewards.math_rewards import accuracy_reward, counting_reward, format_reward
from trainer.rewards.shaping import cosine, repetition, soft_overlong

RewardFn = Callable[..., list]


class RewardSpecError(ValueError):
    """A reward spec that names no reward, or one that cannot be built with the given args."""


def _plain(fn: RewardFn) -> Callable[[], RewardFn]:
    # Rewards without parameters still go through a factory, so that passing them args is caught uniformly.
    def factory() -> RewardFn:
        return fn

    return factory


_FACTORIES: dict[str, Callable[..., RewardFn]] = {
    "format": _plain(format_reward),
    "accuracy": _plain(accuracy_reward),
    "countdown": _plain(countdown_reward),
    "counting": _plain(counting_reward),
    "cosine": cosine,
    "repetition": repetition,
    "soft_overlong": soft_overlong,
}
REWARD_NAMES: tuple[str, ...] = tuple(_FACTORIES)


def available_rewards() -> tuple[str, ...]:
    """The built-in reward names."""
    return REWARD_NAMES


def resolve_reward(spec: str, args: Mapping | None = None, *, base_dir: str | Path | None = None) -> RewardFn:
    """The reward function for `spec` (a built-in name or a `module:function` / `file.py:function` plug-in)."""
    args = dict(args or {})
    if not isinstance(spec, str) or not spec.strip():
        raise RewardSpecError(f"reward spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if ":" in spec:
        return _plugin(spec, args, base_dir)
    factory = _FACTORIES.get(spec)
    if factory is None:
        raise RewardSpecError(
            f"unknown reward {spec!r}; valid names are {', '.join(REWARD_NAMES)}, "
            "or a plug-in 'package.module:function' or 'path/to/file.py:function'"
        )
    _check_args(factory, args, f"reward {spec!r}", complete=True)
    try:
        return factory(**args)
    except ValueError as error:  # a bad parameter value; the factory's message names it
        raise RewardSpecError(str(error)) from error


def _plugin(spec: str, args: dict, base_dir: str | Path | None) -> RewardFn:
    target, _, attribute = spec.rpartition(":")  # rpartition: a Windows path keeps its drive letter
    if not target or not attribute:
        raise RewardSpecError(f"reward plug-in {spec!r} must look like 'module:function' or 'file.py:function'")
    if target.endswith(".py"):
        module, where = _load_file(target, base_dir, spec)
    else:
        module, where = _import_module(target, spec), f"module {target!r}"
    fn = getattr(module, attribute, None)
    if fn is None:
        raise RewardSpecError(f"reward plug-in {spec!r}: {where} has no attribute {attribute!r}")
    if not callable(fn):
        raise RewardSpecError(f"reward plug-in {spec!r}: {attribute!r} in {where} is not callable")
    if not args:
        return fn
    _check_args(fn, args, f"reward plug-in {spec!r}", complete=False)
    return functools.update_wrapper(functools.partial(fn, **args), fn)


def _import_module(name: str, spec: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except Exception as error:
        raise RewardSpecError(
            f"reward plug-in {spec!r}: cannot import module {name!r} ({type(error).__name__}: {error})"
        ) from error


def _load_file(target: str, base_dir: str | Path | None, spec: str) -> tuple[ModuleType, str]:
    path = Path(target).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    path = path.resolve()
    where = f"file {str(path)!r}"
    if not path.is_file():
        raise RewardSpecError(f"reward plug-in {spec!r}: {where} does not exist")
    # One module per file path, registered in sys.modules so that loading it twice gives the same functions and
    # objects defined in it can be pickled (dataloader workers, multiprocessing).
    module_name = "grpoflow_reward_plugin_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if module_name in sys.modules:
        return sys.modules[module_name], where
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardSpecError(f"reward plug-in {spec!r}: {where} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise RewardSpecError(
            f"reward plug-in {spec!r}: {where} failed to load ({type(error).__name__}: {error})"
        ) from error
    return module, where


def _check_args(fn: Callable, args: Mapping, label: str, *, complete: bool) -> None:
    """Raise RewardSpecError unless `fn` accepts `args` as keywords; `complete`: they must fill every required
    parameter (a factory), else the rest come at call time (a plug-in reward function)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and C extensions: nothing to check against, the first call will tell
    try:
        bind = signature.bind if complete else signature.bind_partial
        bind(**args)
    except TypeError as error:
        accepted = ", ".join(signature.parameters) or "none"
        raise RewardSpecError(f"{label}: bad args {sorted(args)} ({error}); its parameters: {accepted}") from error
