"""Dataclass configs filled from YAML and dotted CLI overrides, validated with messages that name the field.

    cfg = load_config("examples/tiny.yaml", ["train.lr=3e-4", "data.max_length=512"])

Unknown keys, wrong types and impossible values raise `ConfigError` naming the dotted field (and the file), what was
expected and what was given.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from flashdraft.config.schema import ConfigError, RunConfig


def _check_type(value: Any, hint: Any, where: str) -> Any:
    """Coerce/validate `value` against a type hint; ints are accepted for floats."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check_type(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {hint}", field=where)
    if origin is list:
        if not isinstance(value, list | tuple):
            # A bare string is the usual slip (data.train=a.jsonl): show the list syntax.
            fix = f" (write {where}=[{value}])" if isinstance(value, str) else ""
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}{fix}", field=where)
        (item,) = typing.get_args(hint) or (Any,)
        return [_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}", field=where)
        return dict(value)
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        # YAML 1.1 reads "1e-3" (no dot) as a string; a float field takes it as the number it plainly is.
        try:
            return float(value)
        except ValueError:
            pass
    if hint in (int, float) and isinstance(value, bool) or not isinstance(value, hint):
        raise ConfigError(f"{where}: expected {hint.__name__}, got {type(value).__name__} {value!r}", field=where)
    return value


def from_dict(cls, data: dict, prefix: str = ""):
    """Build dataclass `cls` from a nested mapping; unknown keys and wrong types raise ConfigError."""
    if not isinstance(data, dict):
        section = prefix.rstrip(".")
        raise ConfigError(
            f"{section or 'config'}: expected a mapping of fields, got {type(data).__name__} {data!r}",
            field=section or None,
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else f"; valid: {', '.join(fields)}"
            raise ConfigError(f"unknown field {where}{hint}", field=where)
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = from_dict(hint, value or {}, prefix=f"{where}.")
        else:
            kwargs[key] = _check_type(value, hint, where)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section", field=dotted)
    node[leaf] = value


def _set_by(field: str | None, overrides: dict[str, str]) -> str | None:
    """The override (`key=value`) that set `field` or the section or field above/below it, if any."""
    if field is None:
        return None
    for key, item in reversed(overrides.items()):
        if field == key or field.startswith(f"{key}.") or field.startswith(f"{key}[") or key.startswith(f"{field}."):
            return item
    return None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """YAML file (optional) + `section.field=value` overrides (values parsed as YAML) → validated RunConfig."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
        if not isinstance(tree, dict):
            raise ConfigError(
                f"{path}: expected a mapping of sections ({', '.join(_SECTIONS)}) at the top level, "
                f"got a YAML {type(tree).__name__}"
            )
    given: dict[str, str] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected section.field=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({exc.problem})") from None
        _set_dotted(tree, key, value)
        given[key] = item
    try:
        return from_dict(RunConfig, tree).validate()
    except ConfigError as exc:
        # Name where the bad value came from: the override that set it, else the YAML file.
        item = _set_by(exc.field, given)
        where = f"override {item}" if item is not None else str(path) if path is not None else None
        raise ConfigError(f"{where}: {exc}" if where else str(exc), field=exc.field) from None


_SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def describe_fields(cls=RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, doc) of every field — for `flashdraft train --help-config`."""
    docs: dict[str, str] = {}
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    for node, nxt in zip(body, body[1:] + [None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            rows += describe_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append((f"{prefix}{f.name}", repr(default), docs.get(f.name, "")))
    return rows
