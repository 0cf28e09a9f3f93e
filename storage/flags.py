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


def read_config_file(path: str | None, cls: type) -> dict[str, Any]:
    """The settings in a JSON config file, refused if it names a field `cls` does not have."""
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
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"config file {path!r} has unknown settings {unknown}; known: {sorted(known)}")
    return values


def _help(f: dataclasses.Field) -> str:
    text = f.metadata["help"]
    if not (f.default is _MISSING or f.default is None or isinstance(f.default, bool)):  # a bool flag: off
        shown = (_size_text(f.default) if f.metadata.get("parse") is parse_size else
                 f"{f.default:g}" if isinstance(f.default, float) else str(f.default))
        text = text.replace("{default}", shown) if "{default}" in text else f"{text} (default {shown})"
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
