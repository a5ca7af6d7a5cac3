"""Turning a reward spec from a recipe into a reward function.

A spec is one of
- a built-in name (`available_rewards()`): `format`, `accuracy`, `countdown`, `counting`, `cosine`,
  `repetition`, `soft_overlong`; `args` are the factory's parameters (`cosine`, `repetition`, `soft_overlong`
  take some, the others none);
- `package.module:function`: imported with importlib;
- `path/to/file.py:function`: loaded from that file (relative to `base_dir` when given, else to the working
  directory). This runs the file: it is code the user put in their recipe, like any import. Model text is
  never loaded or run anywhere in this package.

For a plug-in, `args` are bound to the function as keyword arguments (`functools.partial`), so a plug-in is
the reward function itself, with the TRL signature `f(prompts, completions, **columns)`.

Every failure raises RewardSpecError (a ValueError) naming the spec and what was expected.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path

from data.errors import GrpoflowUserError
from trainer.plugins import PluginError, load_plugin
from trainer.rewards.countdown import countdown_reward
from trainer.rewards.math_rewards import accuracy_reward, counting_reward, format_reward
from trainer.rewards.runner import RewardFn
from trainer.rewards.shaping import cosine, repetition, soft_overlong


class RewardSpecError(GrpoflowUserError, ValueError):
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
    """The reward function for `spec` (a built-in name or a `module:function` / `file.py:function`
    plug-in)."""
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
    try:
        fn = load_plugin(spec, base_dir, what="reward plug-in")
    except PluginError as error:
        raise RewardSpecError(str(error)) from error
    if not args:
        return fn
    _check_args(fn, args, f"reward plug-in {spec!r}", complete=False)
    return functools.update_wrapper(functools.partial(fn, **args), fn)


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
        raise RewardSpecError(
            f"{label}: bad args {sorted(args)} ({error}); its parameters: {accepted}"
        ) from error
