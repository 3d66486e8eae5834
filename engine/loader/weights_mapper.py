"""The one weights mapper: renames checkpoint tensor names to the Hugging Face names models use.

Every loader (GGUF, safetensors) routes its names through a `WeightsMapper`; a loader's whole naming
knowledge is one mapper value, so it can be read and tested without any file.

Within one mapper each rule kind is tried in this order, and within a kind the first match wins:

    | step   | matches when                    | result                                    |
    |--------|---------------------------------|-------------------------------------------|
    | prefix | name.startswith(key)            | value + name[len(key):]                   |
    | regex  | re.search(pattern, name)        | re.sub(pattern, repl, name, count=1)      |
    | suffix | name.endswith(key)              | name[:-len(key)] + value                  |

A value (or repl) of None drops the tensor: `map_name` returns None and later steps do not run.
A name no rule matches passes through unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class WeightsMapper:
    orig_to_new_prefix: dict[str, str | None] = field(default_factory=dict)
    orig_to_new_regex: list[tuple[str, str | None]] = field(default_factory=list)
    orig_to_new_suffix: dict[str, str | None] = field(default_factory=dict)
    # The mapper applied to this one's output; set by `|`, not by hand.
    then: WeightsMapper | None = None

    def map_name(self, name: str) -> str | None:
        """The new name, or None when the tensor is to be dropped."""
        mapped = self._map_own(name)
        if mapped is None or self.then is None:
            return mapped
        return self.then.map_name(mapped)

    def __or__(self, other: WeightsMapper) -> WeightsMapper:
        """`a | b` applies a, then b to a's result (like a shell pipe); a drop by either drops.

        NOTE: vLLM's `WeightsMapper.__or__` merges the rule dicts instead (right side wins on equal keys).
        We chain because then each mapper's rules see the names they were written for: `b` never has to
        know the checkpoint's original names, only `a`'s output.
        """
        if not isinstance(other, WeightsMapper):
            return NotImplemented
        return replace(self, then=other if self.then is None else self.then | other)

    def _map_own(self, name: str) -> str | None:
        for orig, new in self.orig_to_new_prefix.items():
            if name.startswith(orig):
                if new is None:
                    return None
                name = new + name[len(orig) :]
                break
        for pattern, repl in self.orig_to_new_regex:
            if re.search(pattern, name):
                if repl is None:
                    return None
                name = re.sub(pattern, repl, name, count=1)
                break
        for orig, new in self.orig_to_new_suffix.items():
            if name.endswith(orig):
                if new is None:
                    return None
                name = name[: len(name) - len(orig)] + new
                break
        return name
