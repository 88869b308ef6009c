"""A recipe section's table checked against the config dataclass it builds: `section`.

Owns the one copy of the per-field checks every recipe section gets — unknown fields and values of
the wrong type raise one ConfigError naming ``section.field`` — so a config with sub-tables (e.g.
``[spot]`` and ``[spot.synthetic]``) checks each with the same rules as `spotlight.recipe` does.

Knows dataclasses and the TOML value types; nothing of what the configs configure or of files.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, get_args, get_origin, get_type_hints

from spotlight.errors import ConfigError


def section(name: str, cls: type, values: dict[str, Any]):
    """``cls(**values)`` once every key is a field of ``cls`` and every value has the field's type
    (an int is a float; None only where the field allows it); else the ConfigError names
    ``name.key``. The dataclass's own validation then runs as usual."""
    hints = get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"unknown field {name}.{key}; known: {', '.join(sorted(known))}")
        _check_type(f"{name}.{key}", value, hints[key])
    return cls(**values)


def _check_type(field_name: str, value: Any, hint) -> None:
    allowed = get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for t in allowed:
        if t is type(None) and value is None:
            return
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return
        if t in (str, bool) and isinstance(value, t):
            return
        if get_origin(t) is list and isinstance(value, list):
            (item,) = get_args(t)
            for i, v in enumerate(value):
                _check_type(f"{field_name}[{i}]", v, item)
            return
    names = " or ".join(getattr(t, "__name__", str(t)) for t in allowed)
    raise ConfigError(f"{field_name} must be {names}, got {value!r}")
