"""KEY=VALUE pairs, as labels and environment variables arrive from query strings and flags."""

from __future__ import annotations

from cella import errors


def parse_pairs(items: list[str] | None, what: str = "item") -> dict[str, str]:
    result = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise errors.InvalidArgument(f"{what} must be KEY=VALUE, got {item!r}")
        result[key] = value
    return result
