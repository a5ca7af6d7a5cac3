"""Typed configuration from YAML: nested dataclasses built from dicts, with `key=value` overrides.

Every error names the file, the dotted key and what was expected, and an unknown key lists the valid
keys with the closest match first. Values are checked against the dataclass type hints (bool, int,
float, str, Literal choices, Optional, list[...], dict[str, ...], nested dataclasses).

Numbers are checked for meaning too, so that a NaN learning rate or a negative temperature never reaches
the trainer: a float must be finite (`.nan`, `.inf` are refused) unless its field says
`metadata={"finite": False}`, and a field may bound its value (and each item of a list of numbers) with
`metadata` keys `gt`, `ge`, `lt`, `le`, and a list or mapping its length with `min_len`.

YAML is read within bounds, so that a recipe cannot make loading it (or reporting an error in it) the
expensive part: a file is at most `MAX_YAML_BYTES`, and a document (a file, or one override's value) at most
`MAX_YAML_VALUES` values with its aliases expanded, which refuses an alias bomb (a kilobyte of nested anchors
that stands for millions of values) and a recursive alias before any value is built. Error messages show a bad
value cut to 80 characters (`data.errors.short_repr`).
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

from data.errors import GrpoflowUserError, short_repr

MAX_YAML_BYTES = 1 << 20  # a recipe is a few kilobytes; a megabyte is not a recipe
MAX_YAML_VALUES = 100_000  # values of one document with its aliases expanded (a recipe has a few hundred)


class ConfigError(GrpoflowUserError, ValueError):
    """A configuration value or key is wrong; the message names the file and the key."""


def yaml_key(f: dataclasses.Field) -> str:
    """The YAML name of a field: `metadata={"key": "async"}` lets a field be named like a keyword."""
    return f.metadata.get("key", f.name)


def field_help(f: dataclasses.Field) -> str:
    """The help text a field declares (`metadata={"help": ...}`), or ""."""
    return f.metadata.get("help", "")


BOUND_KEYS = ("gt", "ge", "lt", "le", "min_len")  # the metadata keys `build` checks a value against


def field_bounds(f: dataclasses.Field) -> dict[str, float]:
    """The bounds a field declares, by metadata key (`{"ge": 1, "le": 65536}`); empty when it has none."""
    return {name: f.metadata[name] for name in BOUND_KEYS if name in f.metadata}


def did_you_mean(key: str, valid: typing.Iterable[str]) -> str:
    """` (did you mean 'X'?)` naming the valid key closest to a misspelled one, or "" when none is close."""
    close = difflib.get_close_matches(key, list(valid), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _where(source: str, key: str) -> str:
    return f"{source}: {key}" if key else source


def build(cls: type, data: Any, source: str = "<config>", prefix: str = ""):
    """Build dataclass `cls` from a mapping, checking keys and types recursively."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{_where(source, prefix[:-1] or '<top level>')}: expected a mapping, got {_show(data)}"
        )
    fields = {yaml_key(f): f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = _key_text(unknown[0])
        hint = did_you_mean(key, fields)
        raise ConfigError(
            f"{source}: unknown key '{prefix}{key}'{hint}; valid keys"
            f"{' in ' + repr(prefix[:-1]) if prefix else ''}: {', '.join(sorted(fields))}"
        )
    hints = get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        f = fields[key]
        kwargs[f.name] = _coerce(
            hints[f.name], value, source, f"{prefix}{key}", finite=f.metadata.get("finite", True)
        )
        _check_bounds(f, kwargs[f.name], source, f"{prefix}{key}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{_where(source, prefix[:-1])}: {e}") from None


_BOUNDS = {
    "gt": (operator.gt, ">"),
    "ge": (operator.ge, ">="),
    "lt": (operator.lt, "<"),
    "le": (operator.le, "<="),
}


def _check_bounds(f: dataclasses.Field, value: Any, source: str, key: str) -> None:
    """A field's `gt`/`ge`/`lt`/`le` (on a number, or each number of a list) and `min_len` metadata."""
    min_len = f.metadata.get("min_len")
    if min_len is not None and isinstance(value, (list, tuple, dict)) and len(value) < min_len:
        raise ConfigError(
            f"{_where(source, key)}: needs at least {min_len} "
            f"{'entry' if min_len == 1 else 'entries'}, got {short_repr(value)}"
        )
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
                raise ConfigError(
                    f"{_where(source, where)}: must be {symbol} {limit:,}, got {short_repr(item)}"
                )


def _refuse_nonfinite(value: Any, source: str, key: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{_where(source, key)}: must be a finite number, got {value!r}")
    if isinstance(value, dict):
        for k, v in value.items():
            _refuse_nonfinite(v, source, f"{key}.{_key_text(k)}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _refuse_nonfinite(v, source, f"{key}[{i}]")


def _show(value: Any) -> str:
    return f"{type(value).__name__} {short_repr(value)}"


def _key_text(key: Any) -> str:
    """A mapping key as a message shows it (a YAML key may be any value, a long list included)."""
    if isinstance(key, str):
        return key if len(key) <= 80 else key[:80] + "..."
    return short_repr(key)


@dataclasses.dataclass(frozen=True)
class _TypedNumber:
    """A number as an override typed it: a text field takes the text (`1.10`, `0x1F`, `1e3`), any other
    field the number YAML reads."""

    value: int | float
    text: str


def _coerce(tp: Any, value: Any, source: str, key: str, finite: bool = True):
    origin, args = get_origin(tp), get_args(tp)
    if isinstance(value, _TypedNumber):
        text_only = tp is str or (origin in (Union, types.UnionType) and set(args) <= {str, type(None)})
        if text_only:
            return value.text
        value = value.value
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
        raise ConfigError(
            errors[0]
            if len(errors) == 1
            else f"{_where(source, key)}: expected {_type_name(tp)}, got {_show(value)}"
        )
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(
            f"{_where(source, key)}: {short_repr(value)} is not a valid choice; choose one of "
            f"{', '.join(repr(a) for a in args)}"
        )
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
        return {str(k): _coerce(vt, v, source, f"{key}.{_key_text(k)}", finite) for k, v in value.items()}
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
            try:
                number = float(value)
            except OverflowError:  # an integer past the largest float (about 1.8e308)
                raise ConfigError(
                    f"{_where(source, key)}: must be a finite number, got {short_repr(value)}, past the "
                    "largest float"
                ) from None
            if finite and not math.isfinite(number):
                raise ConfigError(f"{_where(source, key)}: must be a finite number, got {value!r}")
            return number
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


def type_text(tp: Any) -> str:
    """A field's type as a recipe's reader writes it: `float | None`, `list[int]`, `"grpo" | "dapo"`."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        named = [type_text(a) for a in args if a is not type(None)]
        return " | ".join(named + (["None"] if type(None) in args else []))
    if origin is Literal:  # strings double-quoted, as the defaults are shown
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (list, tuple) or origin is dict:
        inner = ", ".join(type_text(a) for a in args)
        return f"{origin.__name__}[{inner}]" if args else origin.__name__
    if tp is Any:
        return "any"
    return tp.__name__ if isinstance(tp, type) else _type_name(tp)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.learning_rate=1e-4` -> (['train', 'learning_rate'], 1e-4); values are parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {short_repr(text)}: expected key=value, e.g. train.learning_rate=1e-4")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {short_repr(text)}: empty key")
    value = safe_load(raw, f"override {short_repr(key)}") if raw.strip() else ""
    as_text = value if isinstance(value, str) else raw.strip()  # what a text field gets: quotes are YAML's
    # YAML reads 1e-4 as a string (it wants 1.0e-4); people type 1e-4.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value.lower() for c in ".e") else value
        except ValueError:
            pass
    if isinstance(value, (int, float)) and not isinstance(value, bool) and str(value) != as_text:
        value = _TypedNumber(value, as_text)  # "1.10" stays "1.10" where a text field takes it
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
                raise ConfigError(f"override {short_repr(text)}: '{part}' is not a section")
            node = child
        node[path[-1]] = value
    return data


class _ExpansionError(yaml.YAMLError):
    pass


class BoundedLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a document of more than `MAX_YAML_VALUES` values with its aliases
    expanded, or with an alias inside the node it names. Aliases are counted on the composed nodes, where
    an alias is still one shared node: the count costs one visit per distinct node, never the expansion."""

    def compose_document(self):
        node = super().compose_document()
        _expanded_size(node, {}, set())
        return node


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    if isinstance(node, yaml.ScalarNode):
        return 1
    if id(node) in sizes:
        return sizes[id(node)]
    line = node.start_mark.line + 1
    if id(node) in open_nodes:
        raise _ExpansionError(f"line {line}: an alias refers to a node that contains it (a recursive alias)")
    open_nodes.add(id(node))
    children = node.value if isinstance(node, yaml.SequenceNode) else [n for pair in node.value for n in pair]
    total = 1
    for child in children:
        total += _expanded_size(child, sizes, open_nodes)
        if total > MAX_YAML_VALUES:  # each child's own count is at most the limit: this stops early
            raise _ExpansionError(
                f"line {line}: more than {MAX_YAML_VALUES:,} values once its aliases are "
                "expanded (a recipe has a few hundred); write the values out or use fewer "
                "aliases"
            )
    open_nodes.discard(id(node))
    sizes[id(node)] = total
    return total


def safe_load(text: str, source: str) -> Any:
    """`yaml.safe_load` within `MAX_YAML_VALUES`; a ConfigError naming `source` for anything that is not
    valid, bounded YAML."""
    try:
        return yaml.load(text, Loader=BoundedLoader)  # noqa: S506 (a SafeLoader subclass)
    except _ExpansionError as e:
        raise ConfigError(f"{source}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply to read") from None
    except ValueError as e:  # an integer past Python's digit limit
        raise ConfigError(f"{source}: not valid YAML: {str(e)[:200]}") from None


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    too_big = f"{path}: larger than {MAX_YAML_BYTES:,} bytes, the most a recipe file may be"
    if path.stat().st_size > MAX_YAML_BYTES:
        raise ConfigError(too_big)
    with open(path, "rb") as f:
        raw = f.read(MAX_YAML_BYTES + 1)  # the file may have grown since stat
    if len(raw) > MAX_YAML_BYTES:
        raise ConfigError(too_big)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    data = safe_load(text, str(path))
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
