"""Config classes, flags and TOML keys built from a settings schema of the Rust core.

The scheduler's settings are declared once, in Rust (`rust/src/settings.rs`): each field's
name, doc, kind and default. `settings_class` makes a frozen dataclass of them (other
classes extend it with settings of their own), `settings_values` gives the JSON-ready
values the core parses, and `add_settings_flags` / `parse_setting` give the command line
and config files the same names, docs and checks. A field added in Rust appears everywhere
without another edit.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

Schema = list[dict[str, Any]]

_PY_TYPES = {"float": "float", "int": "int", "bool": "bool", "str": "str", "choice": "str"}


def _annotation(kind: dict[str, Any]) -> str:
    if kind["type"] == "list":
        text = f"tuple[{_annotation(kind['item'])}, ...]"
    else:
        text = _PY_TYPES.get(kind["type"], "object")
    return f"{text} | None" if kind.get("nullable") else text


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def settings_fields(
    schema: Schema, *, nested: Mapping[str, type] | None = None, exclude: Iterable[str] = ()
) -> list[tuple[str, str, dataclasses.Field]]:
    """`make_dataclass` fields of `schema`, the field's doc in its metadata; a nested
    settings field defaults to a fresh instance of its class in `nested`."""
    nested = nested or {}
    skip = set(exclude)
    fields = []
    for f in schema:
        if f["name"] in skip:
            continue
        meta = {"doc": f["doc"], "kind": f["kind"]}
        if f["name"] in nested:
            cls = nested[f["name"]]
            spec = dataclasses.field(default_factory=cls, metadata=meta)
            fields.append((f["name"], cls.__name__, spec))
        else:
            spec = dataclasses.field(default=_frozen(f["default"]), metadata=meta)
            fields.append((f["name"], _annotation(f["kind"]), spec))
    return fields


def settings_class(
    name: str,
    schema: Schema,
    *,
    doc: str,
    bases: tuple[type, ...] = (),
    nested: Mapping[str, type] | None = None,
    exclude: Iterable[str] = (),
    extra: Iterable[tuple[str, str, dataclasses.Field]] = (),
    module: str | None = None,
) -> type:
    """A frozen dataclass of `schema`'s fields (after `bases`' own) plus `extra`; lists given
    for list fields are stored as tuples."""
    list_fields = [f["name"] for f in schema if f["kind"]["type"] == "list"]

    def __post_init__(self: Any) -> None:
        for field_name in list_fields:
            if hasattr(self, field_name):
                object.__setattr__(self, field_name, _frozen(getattr(self, field_name)))
        parent = super(cls, self)
        if hasattr(parent, "__post_init__"):
            parent.__post_init__()

    fields = settings_fields(schema, nested=nested, exclude=exclude) + list(extra)
    cls = dataclasses.make_dataclass(
        name,
        fields,
        bases=bases,
        frozen=True,
        namespace={"__post_init__": __post_init__, "__doc__": doc},
    )
    if module is not None:
        cls.__module__ = module
    return cls


def settings_values(obj: object, schema: Schema) -> dict[str, Any]:
    """The values of `schema`'s fields on `obj` (nested settings as dicts), as the core's
    serde form takes them."""
    out: dict[str, Any] = {}
    for f in schema:
        value = getattr(obj, f["name"])
        if f["kind"]["type"] == "settings":
            value = settings_values(value, f["fields"])
        elif isinstance(value, tuple):
            value = list(value)
        out[f["name"]] = value
    return out


def parse_setting(field: dict[str, Any], text: Any) -> Any:
    """A setting's value from a flag (text) or a config file (already typed): `none` for
    an optional field, comma-separated lists, dashes or underscores in a choice."""
    kind, name = field["kind"], field["name"]
    if kind.get("nullable") and (text is None or str(text).lower() == "none"):
        return None
    if kind["type"] == "list":
        parts = [p for p in text.split(",") if p.strip()] if isinstance(text, str) else text
        return tuple(parse_setting({"name": name, "kind": kind["item"]}, p) for p in parts)
    try:
        if kind["type"] == "choice":
            value = str(text).strip().replace("-", "_")
            if value not in kind["choices"]:
                raise ValueError(f"choose one of {', '.join(kind['choices'])}")
            return value
        if kind["type"] == "bool":
            if isinstance(text, bool):
                return text
            raise ValueError("expected true or false")
        if kind["type"] == "int":
            if isinstance(text, bool) or (isinstance(text, float) and not text.is_integer()):
                raise ValueError("expected an integer")
            return int(text)
        if kind["type"] == "float":
            return float(text)
        return str(text)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: {text!r} is invalid ({exc})") from None


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_settings_flags(
    parser: argparse._ActionsContainer,
    schema: Schema,
    *,
    exclude: Iterable[str] = (),
    default_label: str = "default",
) -> list[dict[str, Any]]:
    """One flag per field of `schema` (nested settings flattened): `--name` with the
    field's doc and default (shown as `default_label: value`) as help, a boolean as
    `--name / --no-name`. Returns the fields given flags; their values arrive unparsed
    (`parse_setting`)."""
    skip = set(exclude)
    added = []
    for f in schema:
        if f["name"] in skip:
            continue
        if f["kind"]["type"] == "settings":
            added += add_settings_flags(
                parser, f["fields"], exclude=exclude, default_label=default_label
            )
            continue
        default = f["default"]
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        shown = "none" if shown is None else shown
        help_text = f"{f['doc']} ({default_label}: {shown})".replace("%", "%%")
        if f["kind"]["type"] == "bool":
            parser.add_argument(
                flag(f["name"]), action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            choices = f["kind"].get("choices")
            metavar = "{" + ",".join(choices) + "}" if choices else None
            parser.add_argument(flag(f["name"]), metavar=metavar, help=help_text)
        added.append(f)
    return added


def flatten(schema: Schema) -> list[dict[str, Any]]:
    """Every leaf field of `schema`, nested settings flattened."""
    out = []
    for f in schema:
        out += flatten(f["fields"]) if f["kind"]["type"] == "settings" else [f]
    return out
