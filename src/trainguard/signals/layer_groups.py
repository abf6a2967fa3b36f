"""`LayerGroups`: parameters grouped into layers by module path, for per-layer reporting."""

from __future__ import annotations

import re
from collections.abc import Sequence


class LayerGroups:
    """Maps each parameter name to a layer group named by the first pattern that matches it."""

    def __init__(self, names: Sequence[str], patterns: Sequence[str]) -> None:
        compiled = [re.compile(p) for p in patterns]
        self.group_names: list[str] = []
        self.index: list[int] = []
        positions: dict[str, int] = {}
        for name in names:
            group = _group_of(name, compiled)
            if group not in positions:
                positions[group] = len(self.group_names)
                self.group_names.append(group)
            self.index.append(positions[group])

    def __len__(self) -> int:
        return len(self.group_names)


def _group_of(name: str, patterns: Sequence[re.Pattern[str]]) -> str:
    for pattern in patterns:
        match = pattern.search(name)
        if match is None:
            continue
        if "group" in pattern.groupindex and match.group("group"):
            return match.group("group")
        return match.group(0)
    return name
