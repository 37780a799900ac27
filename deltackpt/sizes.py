"""Byte counts as people read them.

Example:
    >>> fmt_bytes(512), fmt_bytes(3 * 1024 ** 3)
    ('512 B', '3.0 GiB')
"""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
