"""Whether something can run here, said with its reason, and the version numbers such answers compare: what the machine
checks and every backend answer with."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Availability:
    """Yes, or no with the reason (falsy when not available)."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def version_tuple(version: str | None, parts: int = 3) -> tuple[int, ...]:
    """'10.16.1.11' -> (10, 16, 1); () when unknown."""
    numbers = re.findall(r"\d+", (version or "").split("+")[0])
    return tuple(int(n) for n in numbers[:parts])
