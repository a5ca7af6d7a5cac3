"""Typed configuration from YAML: nested dataclasses built from dicts, with `key=value` overrides.

Every error names the file, the dotted key and what was expected, and an unknown key lists the valid
keys with the closest match first. Values are checked against the dataclass type hints (bool, int,
float, str, Literal choices, Optional, list[...], dict[str, ...], nested dataclasses).

Numbers are checked for meaning too, so that a NaN learning rate or a negative temperature never reaches
the trainer: a float must be finite (`.nan`, `.inf` are refused) unless its field says
`metadata={"finite": False}`, and a field may bound its value (and each item of a list of numbers) with
`metadata` keys `gt`, `ge`, `lt`, `le`, and a list or mapping its length with `min_len`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import operator
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from data.errors import GrpoflowUserError


class ConfigError(GrpoflowUserError, ValueError):
    """A configuration value or key is wrong; the message names the file and the key."""


def yaml_key(f: dataclasses.Field) -> str:
    """The YAML name of a field: `metadata={"key": "async"}` lets a field be named like a keyword."""
    return f.metadata.get("key", f.name)


def field_help(f: dataclasses.Field) -> str:
    return f.metadata.get("help", "")


def _where(source: str, key: str) -> str:
    return f"{source}: {key}" if key else source


def build(cls: type, data: Any, source: str = "<config>", prefix: str = ""):
    """Build dataclass `cls` from a mapping, checking keys and types recursively."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{_where(source, prefix or '<top level>')}: expected a mapping, got {_show(data)}")
    fields = {yaml_key(f): f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), list(fields), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"{source}: unknown key '{prefix}{key}'{hint}; valid keys"
                          f"{' in ' + repr(prefix[:-1]) if prefix else ''}: {', '.join(sorted(fields))}")
    hints = get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        f = fields[key]
        kwargs[f.name] = _coerce(hints[f.name], value, source, f"{prefix}{key}",
                                 finite=f.metadata.get("finite", True))
        _check_bounds(f, kwargs[f.name], source, f"{prefix}{key}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{_where(source, prefix[:-1])}: {e}") from None


_BOUNDS = {"gt": (operator.gt, ">"), "ge": (operator.ge, ">="), "lt": (operator.lt, "<"), "le": (operator.le, "<=")}


def _check_bounds(f: dataclasses.Field, value: Any, source: str, key: str) -> None:
    """A field's `gt`/`ge`/`lt`/`le` (on a number, or each number of a list) and `min_len` metadata."""
    min_len = f.metadata.get("min_len")
    if min_len is not None and isinstance(value, (list, tuple, dict)) and len(value) < min_len:
        raise ConfigError(f"{_where(source, key)}: needs at least {min_len} "
                          f"{'entry' if min_len == 1 else 'entries'}, got {value!r}")
    bounds = [(name, f.metadata[name]) for name in _BOUNDS if name in f.metadata]
    if not bounds:
        return
    items = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
    for i, item in items:
        if not isinstance(item, (int, float)) or isinstance(item, bool):
            continue  # None (an optional field left unset) or a non-number: the type check had its say
        for name, limit in bounds:
            compare, symbol = _BOUNDS[name]
            if not compare(item, limit):
                where = key if i is None else f"{key}[{i}]"
                raise ConfigError(f"{_where(source, where)}: must be {symbol} {limit}, got {item!r}")


def _refuse_nonfinite(value: Any, source: str, key: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{_where(source, key)}: must be a finite number, got {value!r}")
    if isinstance(value, dict):
        for k, v in value.items():
            _refuse_nonfinite(v, source, f"{key}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _refuse_nonfinite(v, source, f"{key}[{i}]")


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _coerce(tp: Any, value: Any, source: str, key: str, finite: bool = True):
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        if finite:  # free-form values (a reward's args) are numbers for someone too
            _refuse_nonfinite(value, source, key)
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, source, key, finite)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f"{_where(source, key)}: expected {_type_name(tp)}, got {_show(value)}")
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{_where(source, key)}: {value!r} is not a valid choice; choose one of "
                          f"{', '.join(repr(a) for a in args)}")
    if dataclasses.is_dataclass(tp):
        return build(tp, value, source, key + ".")
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{_where(source, key)}: expected a list, got {_show(value)}")
        item = args[0] if args else Any
        return [_coerce(item, v, source, f"{key}[{i}]", finite) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{_where(source, key)}: expected a mapping, got {_show(value)}")
        vt = args[1] if args else Any
        return {str(k): _coerce(vt, v, source, f"{key}.{k}", finite) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if finite and not math.isfinite(value):
                raise ConfigError(f"{_where(source, key)}: must be a finite number, got {value!r}")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    else:
        raise ConfigError(f"{_where(source, key)}: unsupported field type {tp!r}")
    raise ConfigError(f"{_where(source, key)}: expected {_type_name(tp)}, got {_show(value)}")


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.learning_rate=1e-4` -> (['train', 'learning_rate'], 1e-4); values are parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. train.learning_rate=1e-4")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key")
    value = yaml.safe_load(raw) if raw.strip() else ""
    # YAML reads 1e-4 as a string (it wants 1.0e-4); people type 1e-4.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value.lower() for c in ".e") else value
        except ValueError:
            pass
    return key.split("."), value


def apply_overrides(data: dict, overrides: typing.Iterable[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: '{part}' is not a section")
            node = child
        node[path[-1]] = value
    return data


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def to_dict(obj) -> Any:
    """A dataclass tree back to plain data, with YAML key names."""
    if dataclasses.is_dataclass(obj):
        return {yaml_key(f): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
