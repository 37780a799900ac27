"""Field checks for the generator configs: each failure names the field and the bad value."""

from __future__ import annotations

import math
import numbers


def require(ok: bool, name: str, value: object, rule: str) -> None:
    """Raise ``ValueError`` naming ``name`` and ``value`` unless ``ok``.

    Args:
        ok: whether the value passed its check.
        name: the config field checked.
        value: the value as given.
        rule: what the value must be, completing "``name`` must be ...".

    Raises:
        ValueError: ``ok`` is false.
    """
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value!r}")


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer, bools excluded (``True`` is no batch size)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """Whether ``value`` is a finite real number, bools excluded."""
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )
