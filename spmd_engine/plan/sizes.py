"""Memory sizes as people write them: `80GiB`, `80GB`, `80e9`, `85899345920`.

A card's memory is quoted both ways (an "80 GB" H100 holds 80 GiB), so both
unit families are taken at their word: GB = 10^9 bytes, GiB = 2^30. A bare
`G` or `M` is refused rather than guessed at.
"""

from __future__ import annotations

import re

from spmd_engine.config import ConfigError

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str, flag: str = "--gpu-memory") -> int:
    """Bytes in `text`, or a ConfigError naming the flag and the forms it takes."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in UNITS:
        raise ConfigError(f"{flag} {text!r} is not a size: give bytes (85899345920, 80e9) or a number "
                          f"with a unit (80GiB, 80GB, 512MiB; units {', '.join(u for u in UNITS if u)})")
    number = match.group(1)
    size = int(number) * UNITS[unit] if number.isdigit() else int(float(number) * UNITS[unit])
    if size < 1:
        raise ConfigError(f"{flag} {text!r} must be at least one byte")
    return size
