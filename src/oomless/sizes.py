"""Byte sizes: parse "20GiB" / "1.5GB" / 512 and print them back for humans."""

import math
import re

from oomless.errors import SizeError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
# A sign is accepted so that "-1GiB" is refused as not positive rather than as unreadable.
_SIZE_PATTERN = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(size: int | float | str) -> int:
    """Return ``size`` in bytes. Accepts ints and strings such as "512MiB", "20GiB", "1.5GB"."""
    if isinstance(size, bool):
        raise SizeError(f"memory size {size!r} is a bool; give bytes as an int or a string like '20GiB'")
    if isinstance(size, float) and not math.isfinite(size):
        raise SizeError(f"memory size must be a finite number of bytes, got {size!r}")
    if isinstance(size, (int, float)):
        if size != int(size):
            # A large one is bytes worked out (0.8 * total), a small one a size meant in a unit.
            hint = (f"whole bytes such as {math.floor(size)}" if abs(size) >= 1024
                    else f"whole bytes, or a string with a unit such as '{size:g}GiB'")
            raise SizeError(f"memory size {size!r} is a fraction of a byte; give {hint}")
        value = int(size)
    elif isinstance(size, str):
        match = _SIZE_PATTERN.match(size)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise SizeError(
                f"memory size {size!r} does not parse; write a number and a unit such as "
                "'512MiB', '20GiB', '1.5GB' or plain bytes like 1073741824 "
                "(units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            )
        number = float(match.group(1)) * _UNITS[unit]
        if _UNITS[unit] == 1 and math.isfinite(number) and number != int(number):
            raise SizeError(f"memory size {size!r} is a fraction of a byte; give whole bytes, or a unit such as "
                            f"'{match.group(1)}GiB'")
        if not math.isfinite(number):
            raise SizeError(f"memory size {size!r} is too large to be a number of bytes")
        value = int(number)
    else:
        raise SizeError(f"memory size must be an int or a string like '20GiB', got {type(size).__name__}")
    if value <= 0:
        raise SizeError(f"memory size must be positive, got {size!r}")
    return value


def format_bytes(num_bytes: int | float) -> str:
    """Human-readable binary size, e.g. 1.50 GiB."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
