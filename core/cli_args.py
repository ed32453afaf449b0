"""Config dataclass -> argparse: the one generator behind `sim`'s SimConfig flags,
`realexec`'s EngineArgs flags and `serve`'s ServerConfig flags.

Each dataclass field is one `--flag` (underscores become dashes) unless its `knob`
metadata names another. A knob the simulator and the real engine share has the same
field name (and so the same flag) in both: vLLM's names (`tensor_parallel_size`,
`max_num_seqs`, `queue_policy`, ...). Old spellings stay accepted as hidden aliases
(`deprecated=`) that print a one-line warning naming the new flag.

Stdlib only (argparse, dataclasses): both backends import it.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Callable

_SCALARS: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}


def knob(default: Any = dataclasses.MISSING, help: str = "", *, group: str | None = None, flag: str | None = None,
         aliases: tuple[str, ...] = (), deprecated: tuple[str, ...] = (), type: Callable[[str], Any] | None = None,
         metavar: str | None = None, choices=None, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field that is one command-line flag.

    `flag`: its spelling (default: --field-name); `aliases`: further visible spellings
    (e.g. vLLM's -tp); `deprecated`: old spellings, hidden from --help, that still work
    and warn (for a bool field an old `--no-...` spelling stores False, any other True);
    `type`: the argparse converter (default: from the annotation: int, float, str);
    `group`: the --help section."""
    meta = {"help": help, "group": group, "flag": flag, "aliases": tuple(aliases), "deprecated": tuple(deprecated),
            "type": type, "metavar": metavar, "choices": choices}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_of(f: dataclasses.Field) -> str:
    """The flag of a field: its knob's `flag`, else --field-name."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def field_flag(cls: type, name: str, value: Any = None) -> str:
    """`cls`'s flag for field `name`, as a user would type it with `value` (for messages):
    a bool as --flag / --no-flag, another value as `--flag VALUE`, None: the flag alone."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if name not in fields:
        raise KeyError(f"{cls.__name__} has no field {name!r}")
    flag = flag_of(fields[name])
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return flag if value is None else f"{flag} {value}"


def _is_bool(f: dataclasses.Field) -> bool:
    return f.type in ("bool", bool)


def converter(f: dataclasses.Field) -> Callable[[str], Any]:
    """The argparse type of a non-bool field: its knob's `type`, else from its annotation
    (`int`, `float | None`, `str`, ...)."""
    if f.metadata.get("type") is not None:
        return f.metadata["type"]
    ann = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    parts = {p.strip() for p in ann.replace("Optional[", "").rstrip("]").split("|")} - {"None"}
    if len(parts) == 1 and (name := parts.pop()) in _SCALARS:
        return _SCALARS[name]
    raise TypeError(f"field {f.name!r} ({ann}): no argparse type; give knob(..., type=...)")


class _Deprecated(argparse.Action):
    """A hidden old spelling: stores like the new flag and says so on stderr (one line)."""

    def __init__(self, option_strings, dest, new: str, const=None, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, nargs=0 if const is not None else None, const=const, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"warning: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, self.const if self.const is not None else values)


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, *, group: str | None = None,
                       skip: tuple[str, ...] = ()) -> dict[str, argparse._ArgumentGroup]:
    """Add one flag per init field of dataclass `cls` to `parser`, in --help sections (a
    knob's `group`, else `group`, else the parser itself); returns the sections by name so
    callers can add to them. Help ends with the default, unless it is None."""
    groups: dict[str, argparse._ArgumentGroup] = {}

    def section(name: str | None):
        if name is None:
            return parser
        if name not in groups:
            groups[name] = parser.add_argument_group(name)
        return groups[name]

    for f in dataclasses.fields(cls):
        if not f.init or f.name in skip:
            continue
        meta = f.metadata
        target = section(meta.get("group") or group)
        flag = flag_of(f)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        help_ = (meta.get("help") or "") + (f" (default: {default})" if default is not None else "")
        if _is_bool(f):
            target.add_argument(flag, *meta.get("aliases", ()), dest=f.name, default=default,
                                action=argparse.BooleanOptionalAction, help=help_)
            for old in meta.get("deprecated", ()):
                value = not old.startswith("--no-")
                target.add_argument(old, dest=f.name, action=_Deprecated, const=value,
                                    new=flag if value else f"--no-{flag[2:]}", help=argparse.SUPPRESS)
            continue
        kwargs = {"type": converter(f), "metavar": meta.get("metavar"), "choices": meta.get("choices")}
        target.add_argument(flag, *meta.get("aliases", ()), dest=f.name, default=default, help=help_, **kwargs)
        for old in meta.get("deprecated", ()):
            target.add_argument(old, dest=f.name, action=_Deprecated, new=flag, help=argparse.SUPPRESS, **kwargs)
    return groups


def dataclass_from_args(cls: type, ns: argparse.Namespace, **overrides: Any) -> Any:
    """`cls` built from the parsed flags (fields without a flag in `ns` keep their default)."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if f.init and hasattr(ns, f.name)}
    return cls(**{**values, **overrides})
