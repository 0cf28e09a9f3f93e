"""Command lines and --config files derived from a settings dataclass.

Each setting is one field made by `setting()`: its default and its help live there once, and
`add_flags` turns every field into a flag whose help shows that default, while `settings`
reads a JSON --config file (refusing keys the dataclass does not have) and puts the flags the
user gave on top. A new option is one field. The flags default to None (not the field's
default), so a flag left out never overrides the config file, and a forwarded command line
(`layertap submit`) carries only what the user typed.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, Literal

from layertap.storage.errors import ConfigError
from layertap.storage.units import parse_size

_MISSING: Any = dataclasses.MISSING


def setting(default: Any = _MISSING, *, help: str, flag: str | None = None, metavar: str | None = None,
            parse: Callable[[str], Any] | None = None, choices: Sequence[str] | None = None,
            config_only: bool = False,
            default_factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field that is also a command-line option.

    `help` may hold `{default}` where the default belongs; without it, "(default X)" is appended
    when the default is not None (a None default's meaning belongs in the help text). `flag`
    replaces the name derived from the field (`batch_tokens` -> `--batch-tokens`). `parse` turns
    the flag's text into the field's value (the flag then takes text, kept as typed for a
    forwarded command line). `choices` limits a text setting's flag (a Literal's come from its
    type). `config_only` settings (a nested dict) have no flag.
    """
    meta = {"help": help, "flag": flag, "metavar": metavar, "parse": parse, "choices": choices,
            "config_only": config_only}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def parse_json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object (--chat-template-kwargs '{"enable_thinking": false}')."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return value


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def flag_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` that are command-line options, in declaration order."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("config_only")]


def add_flags(p: Any, cls: type, config_help: str = "JSON file with any of these settings, named as the flags "
                                                      "with _ for - (flags override it)") -> None:
    """Add one option per field of `cls`, and --config. `p` needs only `add_argument` (a parser,
    a group, or `layertap submit`'s recorder)."""
    hints = typing.get_type_hints(cls)
    for f in flag_fields(cls):
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": _help(f)}
        if f.metadata.get("metavar"):
            kw["metavar"] = f.metadata["metavar"]
        kind = _without_none(hints[f.name])
        if kind is bool:
            kw["action"] = "store_true"
        elif f.metadata.get("choices"):
            kw["choices"] = list(f.metadata["choices"])
        elif typing.get_origin(kind) is Literal:
            kw["choices"] = list(typing.get_args(kind))
        elif f.metadata.get("parse") is None and kind in (int, float):
            kw["type"] = kind
        p.add_argument(flag_name(f), **kw)
    p.add_argument("--config", help=config_help)


def settings(cls: type, args: Any) -> dict[str, Any]:
    """The values for `cls`: its --config file's (args.config), then the flags given in `args`
    (those not None), each flag's text parsed by its field's `parse`."""
    values = read_config_file(getattr(args, "config", None), cls)
    for f in flag_fields(cls):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        parse = f.metadata.get("parse")
        if parse is not None:
            try:
                value = parse(value)
            except ValueError as e:
                raise ConfigError(f"{flag_name(f)}: {e}") from None
        values[f.name] = value
    return values


def build(cls: type, values: dict[str, Any], args: Any) -> Any:
    """`cls(**values)` (from `settings`), an error about a setting that came from the --config file
    naming the file: the dataclass's checks name the flag ("--shard-bytes: invalid size -5"), which
    the user did not type."""
    try:
        return cls(**values)
    except ConfigError as e:
        path = getattr(args, "config", None)
        given = set(read_config_file(path, cls)) if path else set()
        source = next((f for f in dataclasses.fields(cls) if f.name in given and getattr(args, f.name, None) is None
                       and flag_name(f) in str(e)), None)
        if source is None:
            raise
        raise ConfigError(f"{e} ({source.name!r} in config file {path!r})") from None


def read_config_file(path: str | None, cls: type) -> dict[str, Any]:
    """The settings in a JSON config file, refused if it names a field `cls` does not have or
    holds a value that field cannot take (`typed_values`)."""
    if not path:
        return {}
    try:
        with open(path) as f:
            values = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {path!r} cannot be read: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid JSON: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path!r} must hold a JSON object of settings")
    return typed_values(cls, values, f"config file {path!r}")


# What a JSON value must be for a field of each type (None: not checked here; the dataclass checks it).
_EXPECTED = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list",
             dict: "a JSON object"}


def typed_values(cls: type, values: dict[str, Any], where: str) -> dict[str, Any]:
    """`values` (from a JSON file) for the fields of `cls`: refused if a key is not a field; text
    parsed as the field's flag parses it ("1,3" for --layers, "16MB" for a size, "48" for an int);
    any other value checked against the field's type, so that a wrong one is named here rather
    than failing as a TypeError deep inside. `where` names the source in the messages."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    # a key may be named as its flag is too (`lease_ttl` for --lease-ttl, whose field is lease_ttl_s)
    aliases = {key: f.name for f in fields.values()
               if (key := flag_name(f).lstrip("-").replace("-", "_")) != f.name and key not in fields}
    both = sorted(k for k in values if k in aliases and aliases[k] in values)
    if both:
        raise ConfigError(f"{where} names {both[0]!r} and {aliases[both[0]]!r}, one setting: keep one")
    values = {aliases.get(k, k): v for k, v in values.items()}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown settings {unknown}; known: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    return {k: _typed(fields[k], hints[k], v, where) for k, v in values.items()}


def _typed(f: dataclasses.Field, hint: Any, value: Any, where: str) -> Any:
    kind = _without_none(hint)
    parse = f.metadata.get("parse") or (kind if kind in (int, float) else None)
    if isinstance(value, str) and parse is not None:
        try:
            return parse(value)
        except ValueError as e:
            detail = f"must be {_EXPECTED[kind]}" if parse is kind else str(e)
            raise ConfigError(f"{where}: {f.name} {value!r}: {detail}") from None
    if value is None and kind is not hint:  # an optional setting left unset
        return value
    base = typing.get_origin(kind) or kind
    if base not in _EXPECTED:  # a Literal, a tuple: the dataclass checks those
        return value
    item = typing.get_args(kind)[0] if base is list and typing.get_args(kind) else None
    if not _is(value, base) or (item is not None and not all(_is(v, item) for v in value)):
        what = _EXPECTED[base] + (f" whose items are each {_EXPECTED[item]}" if item in _EXPECTED else "")
        shown = "a " + type(value).__name__ if f.name == "endpoint_url" else json.dumps(value)  # may hold a password
        raise ConfigError(f"{where}: {f.name} must be {what}, got {shown}")
    return value


def _is(value: Any, kind: Any) -> bool:
    """isinstance, with JSON's numbers: an int is a float, but true and false are no numbers."""
    if kind not in _EXPECTED:
        return True
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, (int, float) if kind is float else kind)


def _help(f: dataclasses.Field) -> str:
    text = f.metadata["help"]
    if not (f.default is _MISSING or f.default is None or isinstance(f.default, bool)):  # a bool flag: off
        shown = (_size_text(f.default) if f.metadata.get("parse") is parse_size else
                 f"{f.default:g}" if isinstance(f.default, float) else str(f.default))
        if "{default}" in text:
            text = text.replace("{default}", shown)
        elif "(default " not in text:  # a help that says its default in its own words keeps them
            text = f"{text} (default {shown})"
    return text.replace("%", "%%")  # argparse formats help with %


def _size_text(n: int) -> str:
    """A byte count as the size a user would type: 1000000000 -> 1GB, 4294967296 -> 4GiB."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("TB", 10**12), ("GB", 10**9),
                        ("MB", 10**6)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _without_none(kind: Any) -> Any:
    """`int | None` -> int; other types as they are."""
    if typing.get_origin(kind) not in (typing.Union, types.UnionType):
        return kind
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if len(args) == 1 else kind
