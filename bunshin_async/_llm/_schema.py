"""A validator for the JSON-schema subset that tool parameters use.

Supported keywords: ``type`` (object, string, integer, number, boolean, array, null, or a list of them),
``properties``, ``required``, ``additionalProperties`` (bool or schema), ``items``, ``enum``, ``const``,
``anyOf``/``oneOf`` (any branch matching is enough). Everything else (``description``, ``default``, formats, bounds)
is ignored, so a schema the validator does not fully understand only ever accepts more, never less.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["validate"]


def _type_ok(name: str, value: Any) -> bool:
    if name == "object":
        return isinstance(value, dict)
    if name == "string":
        return isinstance(value, str)
    if name == "integer":
        # JSON has one number type: 3.0 is an integer for JSON schema.
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    if name == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if name == "boolean":
        return isinstance(value, bool)
    if name == "array":
        return isinstance(value, list)
    if name == "null":
        return value is None
    return True  # an unknown type name constrains nothing


def validate(schema: Mapping[str, Any], value: Any, path: str = "") -> str | None:
    """Return None if ``value`` fits ``schema``, else a one-line reason naming the offending path
    (``$.command``)."""
    here = path or "$"
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_type_ok(n, value) for n in names):
            return f"{here} should be {' or '.join(names)}, not {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{here} should be one of {list(schema['enum'])!r}, not {value!r}"
    if "const" in schema and value != schema["const"]:
        return f"{here} should be {schema['const']!r}, not {value!r}"
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if branches:
            reasons = [validate(b, value, path) for b in branches]
            if all(r is not None for r in reasons):
                return f"{here} matches none of {key}: {reasons[0]}"
    if isinstance(value, dict):
        props: Mapping[str, Any] = schema.get("properties") or {}
        for name in schema.get("required") or ():
            if name not in value:
                return f"{here} lacks required property {name!r}"
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            sub = props.get(name)
            if sub is not None:
                reason = validate(sub, item, f"{here}.{name}")
                if reason:
                    return reason
            elif extra is False:
                return f"{here} has unexpected property {name!r}"
            elif isinstance(extra, Mapping):
                reason = validate(extra, item, f"{here}.{name}")
                if reason:
                    return reason
    if isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, Mapping):
            for i, item in enumerate(value):
                reason = validate(items, item, f"{here}[{i}]")
                if reason:
                    return reason
    return None
