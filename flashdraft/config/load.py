"""Dataclass configs filled from YAML and dotted CLI overrides, validated with messages that name the field.

    cfg = load_config("examples/tiny.yaml", ["optim.lr=3e-4", "data.max_length=512"])

Unknown keys, wrong types and impossible values raise `ConfigError` naming the dotted field (and the file), what was
expected and what was given.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from flashdraft.config.schema import ConfigError, RunConfig


def _check_type(value: Any, hint: Any, where: str) -> Any:
    """Coerce/validate `value` against a type hint; ints are accepted for floats."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = {}
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check_type(value, arg, where)
            except ConfigError as exc:
                errors[arg] = str(exc)
        # A list against `list[int] | str`: what is wrong with it as a list, not that it is no string.
        alike = [e for arg, e in errors.items() if (typing.get_origin(arg) is list) == isinstance(value, list | tuple)]
        if len(errors) == 1 or len(alike) == 1:
            raise ConfigError((alike or list(errors.values()))[0], field=where)
        raise ConfigError(f"{where}: {value!r} matches none of {hint}", field=where)
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


def _set_by(field: str | None, labels: dict[str, str]) -> str | None:
    """What set `field` or the section or field above/below it (`override key=value`, `--flag value`), if any."""
    if field is None:
        return None
    for key, label in reversed(labels.items()):
        if field == key or field.startswith(f"{key}.") or field.startswith(f"{key}[") or key.startswith(f"{field}."):
            return label
    return None


def _read_yaml(path: Path) -> dict:
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
    return tree


def _layers(path, overrides, flags, base) -> tuple[dict, dict[str, str], set[str]]:
    """The config tree (defaults left out) of `base` < the YAML file < dotted overrides < flags; what set each
    dotted key given on the command line; every dotted key given explicitly (file, override or flag)."""
    tree: dict = copy.deepcopy(base) if base else {}
    explicit: set[str] = set()
    if path is not None:
        from_file = _read_yaml(Path(path))
        explicit |= set(_leaves(from_file))
        tree = _merge(tree, from_file)
    labels: dict[str, str] = {}
    given: dict[str, Any] = {}
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
        labels[key], given[key] = f"override {item}", (item, value)
    for label, key, value in flags:
        if key in given and given[key][1] != value:
            raise ConfigError(f"{label} and {given[key][0]} disagree: give one of them", field=key)
        _set_dotted(tree, key, value)
        labels[key] = label
    return tree, labels, explicit | set(labels)


def _leaves(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict) and value and not prefix:
            yield from _leaves(value, f"{key}.")
        else:
            yield f"{prefix}{key}"


def _merge(low: dict, high: dict) -> dict:
    """`high` over `low`, section by section."""
    out = dict(low)
    for key, value in high.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    flags: Sequence[tuple[str, str, Any]] = (),
    base: dict | None = None,
) -> RunConfig:
    """YAML file (optional) + `section.field=value` overrides (values parsed as YAML) → validated RunConfig.

    `flags`: (label, dotted field, value) of the command-line shortcuts given (`("--max-new-tokens 8",
    "eval.max_new_tokens", 8)`), set after the overrides; one that disagrees with an override of the same field is
    an error. `base`: a config tree below the file (a training run's own settings, for `flashdraft eval`).
    """
    tree, labels, _ = _layers(path, overrides, flags, base)
    try:
        return from_dict(RunConfig, tree).validate()
    except ConfigError as exc:
        # Name where the bad value came from: the override or flag that set it, else the YAML file.
        where = _set_by(exc.field, labels) or (str(path) if path is not None else None)
        raise ConfigError(f"{where}: {exc}" if where else str(exc), field=exc.field) from None


def explicit_fields(
    path: str | Path | None = None, overrides: Sequence[str] = (), *, flags: Sequence[tuple[str, str, Any]] = ()
) -> set[str]:
    """The dotted fields that the YAML file, the overrides or the flags set (a section set whole counts as its
    name): what a command tells from a default."""
    return _layers(path, overrides, flags, None)[2]


_SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


class Field(NamedTuple):
    """One config field: its dotted name, type hint, default and docstring."""

    name: str
    hint: Any
    default: Any
    doc: str


@functools.cache
def fields_of(cls=RunConfig, prefix: str = "") -> dict[str, Field]:
    """Every field of `cls` and its sections, by dotted name (read once; do not change the dict)."""
    docs: dict[str, str] = {}
    body = ast.parse(inspect.getsource(cls)).body[0].body
    for node, nxt in zip(body, body[1:] + [None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = inspect.cleandoc(str(nxt.value.value))
    out: dict[str, Field] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(fields_of(hints[f.name], f"{prefix}{f.name}."))
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out[f"{prefix}{f.name}"] = Field(f"{prefix}{f.name}", hints[f.name], default, docs.get(f.name, ""))
    return out


def describe_fields(cls=RunConfig) -> list[tuple[str, str, str]]:
    """(dotted name, default, doc) of every field — for `flashdraft COMMAND --help-config`."""
    return [(f.name, repr(f.default), f.doc) for f in fields_of(cls).values()]
