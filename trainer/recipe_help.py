"""Recipe help a user can read: every recipe field's key, type, default, bounds and help, taken from the
recipe dataclasses (`trainer/recipe.py`), which stay the only place these are written.

- `recipe_fields()` lists one `FieldDoc` per field, in the dataclasses' order, grouped by section (`model`,
  `train`, `rollout`, ...; the top-level `name` and `description` have the section ""). Keys are the dotted
  YAML keys a recipe or an override uses (`train.learning_rate`, `rollout.async`); the fields of one entry
  of the `rewards` list are `rewards[].name`, `rewards[].weight`, `rewards[].args`.
- `explain(key)` picks what `grpoflow recipe explain [KEY]` shows: every field (no key), a section, or one
  field; an unknown key is a `ConfigError` naming the closest valid one.
- `render_text` is the terminal form, `render_markdown` the reference table `docs/recipe.md`
  (`grpoflow recipe explain --markdown > docs/recipe.md` writes it; a test keeps it equal to the dataclasses).

Defaults are shown as YAML flow values that are JSON as well (`null`, `true`, `"dapo"`, `1.0e-06`,
`[0.3, 0.6]`), so a default can be pasted into a recipe or an override as printed.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, get_args, get_origin, get_type_hints

from trainer.recipe import Recipe
from trainer.typed_config import (
    ConfigError,
    did_you_mean,
    field_bounds,
    field_help,
    to_dict,
    type_text,
    yaml_key,
)

GENERATOR = "grpoflow recipe explain --markdown > docs/recipe.md"
_SYMBOLS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


@dataclass(frozen=True)
class FieldDoc:
    key: str  # the dotted YAML key
    section: str  # the top-level key it sits under; "" for a top-level field
    type: str
    default: Any  # plain data, as `to_dict` gives it
    bounds: dict  # metadata key -> limit: {"ge": 1, "le": 65536}; min_len is a list's or mapping's length
    help: str
    each: bool = False  # the bounds hold for each item of a list, not for the list

    def as_dict(self) -> dict:
        return {
            "key": self.key,
            "section": self.section,
            "type": self.type,
            "default": self.default,
            "bounds": self.bounds,
            "bounds_text": self.bounds_text(),
            "help": self.help,
        }

    def default_text(self) -> str:
        return value_text(self.default)

    def bounds_text(self) -> str:
        """`> 0`, `>= 1, <= 65,536`, `each >= 0`, `at least 1 entry`; "" when unbounded."""
        parts = [f"{_SYMBOLS[name]} {limit:,}" for name, limit in self.bounds.items() if name in _SYMBOLS]
        text = ", ".join(parts)
        if text and self.each:
            text = "each " + text
        min_len = self.bounds.get("min_len")
        if min_len is not None:
            text = ", ".join(
                filter(None, [text, f"at least {min_len} {'entry' if min_len == 1 else 'entries'}"])
            )
        return text


@dataclass(frozen=True)
class Section:
    name: str  # "" for the top-level fields
    help: str
    fields: tuple[FieldDoc, ...]


def value_text(value: Any) -> str:
    """A default as a YAML flow value that is also JSON; floats keep a dot (`1.0e-06`: YAML reads `1e-06`
    as text)."""
    if isinstance(value, float):
        text = repr(value)
        return text if "." in text or "e" not in text else text.replace("e", ".0e", 1)
    if isinstance(value, list):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {value_text(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def recipe_sections() -> list[Section]:
    """The recipe's fields by section, in the order the dataclasses declare them (top-level fields first)."""
    hints = get_type_hints(Recipe)
    top: list[FieldDoc] = []
    sections: list[Section] = []
    for f in dataclasses.fields(Recipe):
        key, tp = yaml_key(f), hints[f.name]
        if dataclasses.is_dataclass(tp):
            sections.append(Section(key, field_help(f), tuple(_fields_of(tp, f"{key}.", key))))
        elif get_origin(tp) is list and dataclasses.is_dataclass(item := get_args(tp)[0]):
            whole = _doc(f, tp, key, key)
            sections.append(Section(key, field_help(f), (whole, *_fields_of(item, f"{key}[].", key))))
        else:
            top.append(_doc(f, tp, key, ""))
    return [Section("", "the recipe itself", tuple(top)), *sections]


def recipe_fields() -> list[FieldDoc]:
    """Every recipe field, one `FieldDoc` each."""
    return [doc for section in recipe_sections() for doc in section.fields]


def _fields_of(cls: type, prefix: str, section: str) -> list[FieldDoc]:
    """The fields of `cls`, and after a field holding a settings dataclass of its own (`model.lora`), its
    fields, one row each (`model.lora.r`)."""
    hints, docs = get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key, tp = prefix + yaml_key(f), hints[f.name]
        docs.append(_doc(f, tp, key, section))
        nested = [t for t in (tp, *get_args(tp)) if dataclasses.is_dataclass(t)]
        if nested:
            docs += _fields_of(nested[0], f"{key}.", section)
    return docs


def _doc(f: dataclasses.Field, tp: Any, key: str, section: str) -> FieldDoc:
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    origin = get_origin(tp)
    return FieldDoc(
        key=key,
        section=section,
        type=type_text(tp),
        default=to_dict(default),
        bounds=field_bounds(f),
        help=field_help(f),
        each=origin in (list, tuple),
    )


def explain(key: str | None = None) -> list[Section]:
    """The sections to show for `key`: all (None), one section, or one field inside its section.

    `rewards[0].weight` and `rewards.weight` name `rewards[].weight`. Raises ConfigError for an unknown key,
    naming the closest valid one."""
    sections = recipe_sections()
    if key is None:
        return sections
    wanted = re.sub(r"\[\d*\]", "[]", key.strip())
    if wanted.startswith("rewards.") and wanted != "rewards.":
        wanted = "rewards[]." + wanted[len("rewards.") :]
    for section in sections:
        if section.name and wanted == section.name:
            return [section]
        for doc in section.fields:
            if doc.key == wanted:
                return [Section(section.name, section.help, (doc,))]
    valid = [s.name for s in sections if s.name] + [doc.key for s in sections for doc in s.fields]
    raise ConfigError(
        f"unknown recipe key '{key}'{did_you_mean(wanted, valid)}; `grpoflow recipe explain` lists every key"
    )


def render_text(sections: list[Section]) -> str:
    """The terminal form: a header per section, then per field `key: type = default (bounds)` and its help."""
    blocks = []
    for section in sections:
        lines = [f"[{section.name or 'top level'}] {section.help}"]
        for doc in section.fields:
            bounds = f" ({doc.bounds_text()})" if doc.bounds else ""
            lines.append(f"  {doc.key}: {doc.type} = {doc.default_text()}{bounds}")
            lines.append(f"      {doc.help}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def render_markdown(sections: list[Section]) -> str:
    """The reference table of `docs/recipe.md`: one table per section, one row per field."""
    out = [
        "# Recipe reference",
        "",
        "Every field of a recipe (`configs/*.yaml`), with its type, default, bounds and help, generated from",
        f"the recipe dataclasses in `trainer/recipe.py` by `{GENERATOR}`",
        "(`tests/test_recipe_help.py` fails when this file is out of date). Keys are the dotted keys an",
        "override uses: `grpoflow train train.learning_rate=1e-4`. `grpoflow recipe explain KEY` prints one",
        "field or one section in a terminal.",
        "",
    ]
    for section in sections:
        out += [
            f"## {section.name or 'Top level'}",
            "",
            _cell(section.help),
            "",
            "| key | type | default | bounds | help |",
            "|---|---|---|---|---|",
        ]
        for doc in section.fields:
            out.append(
                f"| `{_cell(doc.key)}` | `{_cell(doc.type)}` | `{_cell(doc.default_text())}` | "
                f"{_cell(doc.bounds_text())} | {_cell(doc.help)} |"
            )
        out.append("")
    return "\n".join(out)


def _cell(text: str) -> str:
    # A pipe would end the table cell, in code spans too (GitHub's tables unescape `\|` inside them).
    return text.replace("|", "\\|").replace("\n", " ")
