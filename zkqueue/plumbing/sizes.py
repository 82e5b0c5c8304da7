"""Byte sizes as people write them ("512MiB", "16GB", "1.5 GiB"): read with ``parse_size``, written
with ``format_size`` (and readable by it)."""

from __future__ import annotations

import re

from zkqueue.errors import ConfigurationError

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_FORMAT_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


class InvalidSize(ConfigurationError, ValueError):
    """A size setting could not be read (a ConfigurationError that is also a ValueError)."""


def parse_size(text: str | int) -> int:
    """Read a byte count: a plain integer or a number with a unit (B, KB/KiB ... TB/TiB)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InvalidSize(f"a size must not be negative, not {text}")
        return text
    if not isinstance(text, str):
        raise InvalidSize(f"a size must be a string or an integer, not {text!r}")
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or (unit and unit not in _UNITS):
        raise InvalidSize(
            f"cannot read size {text!r}: use a number of bytes or a number with one of the units "
            "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
        )
    number, scale = match.group(1), _UNITS.get(unit, 1)
    if "." in number:
        return int(float(number) * scale)
    return int(number) * scale


def format_size(n: int) -> str:
    """Write a byte count in binary units for people, e.g. ``"1.5 GiB"``; readable by parse_size."""
    for unit, scale in _FORMAT_UNITS:
        if abs(n) >= scale:
            value = n / scale
            text = f"{value:.0f}" if n % scale == 0 else f"{value:.1f}"
            return f"{text} {unit}"
    return f"{n} B"
