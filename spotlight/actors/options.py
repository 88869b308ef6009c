"""Command-line options from config dataclasses: one ``--field-name`` per field, with the field's
type, its default and the docstring written under it as help, so a process main never repeats a
config's defaults (``add_options``); ``given`` reads back the options set, ``to_argv`` turns a
config into the options that rebuild it in a child process.

This module knows argparse and dataclasses; nothing of what the configs configure.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
from typing import Any, get_args, get_type_hints


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in ``cls``'s source (one line)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _scalar(hint: Any) -> type:
    args = [a for a in get_args(hint) if a is not type(None)] if isinstance(hint, types.UnionType) else [hint]
    if len(args) != 1 or args[0] not in (str, int, float, bool):
        raise TypeError(f"no command-line form for a field of type {hint}")
    return args[0]


def add_options(parser: argparse.ArgumentParser, cls: type, *, only: tuple[str, ...] | None = None,
                skip: tuple[str, ...] = (), unset: str | None = None) -> None:
    """Add ``--field-name`` for each field of the dataclass ``cls`` (``only`` those, minus
    ``skip``): its type, its default (a field without one is required) and its docstring as help.
    ``unset``: the options default to None (not given) and the help says what applies then."""
    hints, docs = get_type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        if (only is not None and f.name not in only) or f.name in skip:
            continue
        kind, flag = _scalar(hints[f.name]), "--" + f.name.replace("_", "-")
        if f.default_factory is not dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: a factory default has no command-line form; skip it")
        has_default = f.default is not dataclasses.MISSING
        if unset is not None:
            default, note = None, f" ({unset})"
        else:
            default = f.default if has_default else None
            note = (" (required)" if not has_default else
                    "" if default in (None, "") else f" (default: {default})")
        help_ = f"{docs.get(f.name, '')}{note}".replace("%", "%%")
        required = unset is None and not has_default
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_)
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=default, help=help_, required=required)


def given(args: argparse.Namespace, cls: type, only: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The values of ``cls``'s options in ``args`` that were given (not None)."""
    names = [f.name for f in dataclasses.fields(cls) if only is None or f.name in only]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def to_argv(config: Any) -> list[str]:
    """The options that rebuild ``config`` in a child's ``add_options`` parser (None fields left out)."""
    argv = []
    for f in dataclasses.fields(config):
        value, flag = getattr(config, f.name), f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            argv += [f"--{flag}", str(value)]
    return argv
