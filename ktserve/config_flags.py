"""Command-line flags made from frozen config dataclasses, and the dataclasses built back.

A field made with `flag()` is a flag; argparse settings (choices, metavar, nargs, action, type)
go next to its help text. The rest follows from the field:

    name      --field-name, or the one given (--format for weight_format); dest: the field's name
    type      the annotation's: int, float or str (`X | None` is X); `type=` for any other
    default   None: a flag not given leaves the field's default, which %(default)s in the help
              text shows; with `env=` (a name in ktserve/envs.py), the flag's default is that
              environment variable's value
    bool      --x/--no-x, or only the one named (`name="--no-x"`)
    required  when the field has no default (a positional: when nargs asks for it)

A field made with `env_field(var)` is no flag but an experiment's switch, the environment
variable var of ktserve/envs.py: its default is var's, and `from_args` reads var.

A field whose type is a config dataclass adds that dataclass's flags in turn, each dataclass's
under its own heading of --help, from its docstring's first line ("Title: what it holds").
`from_args` builds the dataclass, and those inside it, from the parsed flags and the
environment; their `__post_init__` checks the values.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

from ktserve import envs

T = TypeVar("T")
SCALARS = (int, float, str)


def flag(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    name: str | None = None,
    positional: bool = False,
    env: str | None = None,
    **argparse_kwargs: Any,
) -> Any:
    """A dataclass field that is also a command-line flag (see the module docstring)."""
    spec = dict(help=help, name=name, positional=positional, env=env, argparse=argparse_kwargs)
    return dataclasses.field(default=default, metadata={"flag": spec})


def env_field(var: envs.EnvVar) -> Any:
    """A dataclass field set by the environment variable var, not by a flag (see the module
    docstring)."""
    return dataclasses.field(default=var.default, metadata={"env": var})


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add the flags of cls's fields, and of the config dataclasses among them, to parser."""
    hints = typing.get_type_hints(cls)
    group = None
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if dataclasses.is_dataclass(kind):
            add_flags(parser, kind)
        elif "flag" in field.metadata:
            names, kwargs = _argument(cls, field, kind)
            if field.metadata["flag"]["positional"]:
                parser.add_argument(*names, **kwargs)
                continue
            if group is None:
                title, _, about = (cls.__doc__ or cls.__name__).split("\n")[0].partition(": ")
                group = parser.add_argument_group(title, about or None)
            group.add_argument(*names, **kwargs)


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """cls from the flags add_flags(parser, cls) made and the environment variables of its
    env_field()s; a flag not given, or a variable not set, keeps the default."""
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            values[field.name] = from_args(hints[field.name], args)
        elif "flag" in field.metadata and getattr(args, field.name, None) is not None:
            value = getattr(args, field.name)
            values[field.name] = tuple(value) if isinstance(value, list) else value
        elif "env" in field.metadata:
            values[field.name] = field.metadata["env"].read()
    return cls(**values)


def flag_name(cls: type, name: str) -> str:
    """The flag of cls's field `name`, as users type it."""
    [field] = [f for f in dataclasses.fields(cls) if f.name == name]
    return field.metadata["flag"]["name"] or "--" + name.replace("_", "-")


def comma_list(text: str) -> tuple[str, ...]:
    """A flag's value "a, b,c" as ("a", "b", "c")."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _argument(cls: type, field: dataclasses.Field, kind: Any) -> tuple[list[str], dict]:
    spec = field.metadata["flag"]
    help_text = spec["help"]
    if field.default is not dataclasses.MISSING:
        help_text = help_text.replace("%(default)s", str(field.default))
    kwargs: dict[str, Any] = {"help": help_text, **spec["argparse"]}
    kwargs["default"] = envs.ENV_VARS[spec["env"]].read() if spec["env"] else None
    name = flag_name(cls, field.name)
    base = _without_none(kind)
    if base is bool:
        if name.startswith("--no-"):
            kwargs.update(action="store_const", const=False)
        else:
            kwargs.update(action=argparse.BooleanOptionalAction)
    elif base in SCALARS:
        kwargs.setdefault("type", base)
    elif "type" not in kwargs:
        raise TypeError(f"{cls.__name__}.{field.name}: flag() needs type= to read a {kind}")
    if spec["positional"]:
        return [field.name], kwargs
    if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
        kwargs["required"] = True
    return [name], {"dest": field.name, **kwargs}


def _without_none(kind: Any) -> Any:
    """X for `X | None`; kind itself otherwise."""
    if isinstance(kind, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        return args[0] if len(args) == 1 else kind
    return kind
