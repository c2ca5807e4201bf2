"""Byte sizes as people write and read them: parse_size("8GiB"), human_bytes(3 << 20) == "3.0 MiB"."""
from __future__ import annotations

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30,
          "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def parse_size(text) -> int:
    """A byte size: 8GiB, 512MiB, 1.5G, or a plain number of bytes; ValueError otherwise."""
    value = str(text).strip().lower()
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    try:
        return int(float(number) * _UNITS[value[len(number):]])
    except (KeyError, ValueError):
        raise ValueError(f"{text!r} is not a size (e.g. 8GiB, 512MiB)") from None


def human_bytes(count: int | float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (as membarctl prints them)."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
