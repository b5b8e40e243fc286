"""The typed readers of ``config.json`` fields (an int, a finite float, a bool, a string, lists of them), each
raising a ValueError that names the field, the value and what is allowed: shared by :mod:`dynamoe.models.config`
and the family-specific field parsers (:mod:`dynamoe.models.family_fields`).
"""
from __future__ import annotations

import math
from typing import Any, Optional

__all__ = ["_err", "_int", "_float", "_bool", "_str", "_int_list", "_str_list"]


def _err(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"config field {name!r} must be {allowed}, got {value!r}")


def _int(d: dict, name: str, default: Any = None, minimum: int = 1, required: bool = False) -> Optional[int]:
    v = d.get(name, default)
    if v is None:
        if required:
            raise ValueError(f"config field {name!r} is required (an int >= {minimum}) but missing")
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise _err(name, v, f"an int >= {minimum}")
    return v


def _float(d: dict, name: str, default: Any = None, positive: bool = False) -> Optional[float]:
    v = d.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise _err(name, v, "a finite number" + (" > 0" if positive else ""))
    return float(v)


def _bool(d: dict, name: str, default: bool) -> bool:
    v = d.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _err(name, v, "true or false")
    return v


def _str(d: dict, name: str, default: Optional[str]) -> Optional[str]:
    v = d.get(name, default)
    if v is not None and not isinstance(v, str):
        raise _err(name, v, "a string")
    return v


def _int_list(d: dict, name: str) -> tuple:
    v = d.get(name)
    if v is None:
        return ()
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,)
    if not isinstance(v, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise _err(name, v, "an int or a list of ints")
    return tuple(v)


def _str_list(d: dict, name: str, length: int, allowed: tuple) -> tuple:
    v = d.get(name)
    if v is None:
        return ()
    if not isinstance(v, (list, tuple)) or len(v) != length or any(t not in allowed for t in v):
        raise _err(name, v, f"a list of {length} entries from {list(allowed)}")
    return tuple(v)
