"""The config type system: YAML files (read by `yaml_strict`), dict -> dataclass with type checks, typed dotted
overrides, and the option listings. `config.py` holds the job's dataclasses and binds these to JobConfig.

One dispatcher on the field's annotation, `to_value`, serves YAML values and command-line texts alike:
an override's text is read the way YAML would give the value, then checked by the same rules.

The YAML loader is `yaml_strict` (duplicate keys, YAML 1.2 booleans, a bound on alias expansion); a
syntax error is a ConfigError naming the file, line and column. Float options also take the YAML 1.2
spellings that YAML 1.1 reads as strings (`1e-3`, `5e4`); integer options take integral ones (`1e6`);
every float option must be finite.

One rule for YAML and the command line: an override's value is read by the same YAML loader and then
checked like the YAML value, so `=0` or `=yes` for a bool and `=6.0` for an int are refused on both
paths. String options keep the command-line text as given (paths, templates); a `none` / `null` / `~`
word sets an optional non-string option (`engine.model.tie_word_embeddings`) to null on both paths.
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import yaml

from .yaml_strict import DocumentShapeError, yaml_load


class ConfigError(ValueError):
    """A configuration problem; the message names the offending option."""


# YAML 1.2 core-schema floats (1e-3, 5E4, .5, 2.): YAML 1.1 (PyYAML) reads the exponent forms as strings.
_FLOAT_RE = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")

_NONE_WORDS = ("none", "null", "~")  # null for an optional option that is not a string (any case)


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _type_name(tp) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _finite(x: float, key: str) -> float:
    if not math.isfinite(x):
        raise ConfigError(f"option '{key}' must be a finite number, got {x}")
    return x


def _yaml_text(text: str, key: str, what: str):
    """A command-line value read as YAML (mappings, flow lists, untyped options)."""
    try:
        return yaml_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"option '{key}': cannot parse {what} {text!r}: {e}") from e


def _list_text(text: str, key: str):
    """A command-line list: `[a, b]` (YAML flow form) -> the YAML list (its items are YAML values, checked
    as such); `a,b` -> a tuple of item texts (each read as an override's text)."""
    s = text.strip()
    if not s.startswith("["):
        return tuple(p for p in s.split(",") if p.strip())
    raw = _yaml_text(s, key, "list")
    if not isinstance(raw, list):
        raise ConfigError(f"option '{key}' expects a list, got {text!r}")
    return raw


def _scalar_text(tp, text: str):
    """A command-line scalar for type `tp`: for bool, int and float options the value the YAML loader
    reads from the same text (so `0`, `yes` and `6.0` mean what they mean in YAML); str options keep the
    text as given. The checks follow in `to_value`."""
    if tp not in (bool, int, float):
        return text
    try:
        value = yaml_load(text.strip())
    except yaml.YAMLError:
        return text
    return text if value is None else value


def _is_null(value, args, text: bool) -> bool:
    """Whether `value` sets an Optional option with member types `args` to None: YAML's null, and for an
    option that cannot hold a string also the none words (`none`, `null`, `~`, any case), on both paths."""
    if value is None:
        return True
    if not isinstance(value, str):
        return False
    word = value.strip().lower()
    if str in args:
        return text and word in ("null", "~")  # a string option's text 'none' is the string
    return word in _NONE_WORDS


def to_value(tp, value, key: str, *, text: bool = False):
    """The one type dispatcher of the config: `value` as a value of the annotation `tp`, else a
    ConfigError naming option `key`.

    `value` is a YAML value (int widens to float, a list becomes a tuple where the field says so), or,
    with `text=True`, the command-line text of a `key=value` override: that text is first read by the
    YAML loader (booleans, numbers, `[a, b]` lists and `{a: 1}` mappings; `a,b` lists item by item; str
    options keep the text), then checked by the same rules as a YAML value.
    """
    if dataclasses.is_dataclass(tp):
        raise ConfigError(f"option '{key}' is a section; set its fields ({key}.FIELD)")
    if tp is Any:
        return _yaml_text(value.strip(), key, "value") if text else value
    if _is_union(tp):
        args = typing.get_args(tp)
        value = value.strip() if text else value
        if type(None) in args and _is_null(value, args, text):
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return to_value(arg, value, key, text=text)
            except ConfigError:
                pass
        raise ConfigError(f"option '{key}' expects {_type_name(tp)}, got {value!r}")
    origin = typing.get_origin(tp)
    if origin is dict or tp is dict:
        if text:
            value = _yaml_text(value.strip(), key, "mapping") if value.strip() else {}
        if not isinstance(value, dict):
            raise ConfigError(f"option '{key}' expects a mapping ({_type_name(tp)}), got {value!r}")
        return dict(value)
    if origin in (list, tuple):
        if text:
            value = _list_text(value, key)
            text = isinstance(value, tuple)  # `a,b`: item texts; `[a, b]`: YAML values
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"option '{key}' expects a list ({_type_name(tp)}), got {value!r}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"option '{key}' expects {len(args)} values, got {len(value)}")
            return tuple(to_value(a, v, f"{key}[{i}]", text=text) for i, (a, v) in enumerate(zip(args, value)))
        elem = args[0] if args else Any
        items = [to_value(elem, v, f"{key}[{i}]", text=text) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if text:
        value = _scalar_text(tp, value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()) and float(value).is_integer():
            return int(float(value))  # `1e6`, read by YAML 1.1 as a string
    elif tp is float:
        if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
            value = float(value)  # `1e-3`, read by YAML 1.1 as a string
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return _finite(float(value), key)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"option '{key}' expects {_type_name(tp)}, got {value!r}")


def parse_value(tp, text: str, key: str):
    """The command-line text `text` as a value of type `tp` (the field's annotation)."""
    return to_value(tp, text, key, text=True)


def from_dict(cls, data: Optional[dict], prefix: str = ""):
    """Build dataclass `cls` from a nested dict; unknown keys and wrong types raise ConfigError."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"section '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {data!r}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"unknown option '{prefix}{key}' (valid in this section: {', '.join(names)})")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, value, f"{prefix}{key}.")
        else:
            kwargs[key] = to_value(tp, value, f"{prefix}{key}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # a nested section's own check: say which section
        where = prefix.rstrip(".") or "<root>"
        raise ConfigError(f"invalid section '{where}': {e}") from e


def to_dict(cfg) -> dict:
    """Plain nested dict of a config (tuples as lists, so it round-trips through YAML)."""
    def plain(v):
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(dataclasses.asdict(cfg))


def dump_yaml(cfg) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _field_type(cls, dotted: str):
    """Type of the field at dotted path `dotted` below dataclass `cls`; unknown parts raise."""
    parts = dotted.split(".")
    tp = cls
    for i, part in enumerate(parts):
        if typing.get_origin(tp) is dict or tp is dict or tp is Any:
            return Any  # a key inside a mapping option (e.g. rl.task_options.n=3): YAML-typed value
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"unknown option '{dotted}': '{'.'.join(parts[:i])}' is not a section")
        names = [f.name for f in dataclasses.fields(tp) if f.init]
        if part not in names:
            where = ".".join(parts[:i]) or "<root>"
            raise ConfigError(f"unknown option '{dotted}' (valid in '{where}': {', '.join(names)})")
        tp = _hints(tp)[part]
    return tp


def apply_overrides(data: dict, overrides: Sequence[str], cls) -> dict:
    """Set dotted `key=value` overrides into the nested dict `data` (typed by `cls`'s fields)."""
    data = {} if data is None else data
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. trainer.steps=10)")
        key, text = item.split("=", 1)
        key = key.strip().lstrip("-")
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        value = parse_value(_field_type(cls, key), text, key)
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            elif not isinstance(nxt, dict):
                raise ConfigError(f"section '{part}' in the YAML is not a mapping (override {key})")
            node = nxt
        node[parts[-1]] = value
    return data


def load_yaml(path: Union[str, Path]) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml_load(f)
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({e})") from e
    except DocumentShapeError as e:
        raise ConfigError(f"config file {str(path)!r} is refused: {e}") from e
    except yaml.YAMLError as e:  # syntax error or duplicate key; the message carries line and column
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return data


def load_config(path: Union[str, Path, None], overrides: Sequence[str], cls):
    """YAML file (optional) + dotted overrides -> validated dataclass `cls`."""
    data = load_yaml(path) if path is not None else {}
    data = apply_overrides(data, overrides, cls)
    return from_dict(cls, data)


def iter_fields(cls, prefix: str = ""):
    """Yield (dotted name, type, default, help) for every leaf option below dataclass `cls`."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            yield from iter_fields(tp, name + ".")
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        yield name, tp, default, f.metadata.get("help", "")


def format_help(cls) -> str:
    """Text listing of every option: dotted name, type, default and help string."""
    lines = []
    for name, tp, default, text in iter_fields(cls):
        shown = "<required>" if default is dataclasses.MISSING else repr(default)
        lines.append(f"  {name}  ({_type_name(tp)}, default {shown})")
        if text:
            lines.append(f"      {text}")
    return "\n".join(lines)


def format_markdown(cls) -> str:
    """Markdown tables of every option (one per top-level section), from the help strings."""
    out, section = [], None
    for name, tp, default, text in iter_fields(cls):
        top = name.split(".")[0] if "." in name else ""
        if top != section:
            section = top
            out += ["", f"### `{top}`" if top else "### top level", "",
                    "| option | type | default | meaning |", "|---|---|---|---|"]
        shown = "required" if default is dataclasses.MISSING else repr(default)
        cell = text.replace("|", "\\|")
        out.append(f"| `{name}` | {_type_name(tp)} | `{shown}` | {cell} |")
    return "\n".join(out).strip() + "\n"
