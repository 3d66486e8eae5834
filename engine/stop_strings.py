"""Stop-string policy: what of the streamed text may be emitted, and where it stops.

Pure: text in, decision out. Text that could be the start of a stop string is held back
until the next delta settles it, so emitted text never contains (part of) a stop string,
even one spread over many deltas.
"""

from __future__ import annotations

from typing import NamedTuple

from engine.errors import InvalidRequestError


class StopResult(NamedTuple):
    text_to_emit: str
    stopped: bool
    stop_str: str | None  # the stop string that matched, when stopped


class StopStringMatcher:
    """Feed decoded deltas in order; once `stopped`, later feeds emit nothing."""

    def __init__(self, stops: tuple[str, ...], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stops):
            raise InvalidRequestError("stop strings must be non-empty")
        self._stops = tuple(stops)
        self._include_stop = include_stop_str_in_output
        self._held = ""
        self._stop_str: str | None = None

    @property
    def is_stopped(self) -> bool:
        return self._stop_str is not None

    def feed(self, delta: str) -> StopResult:
        if self._stop_str is not None:
            return StopResult("", True, self._stop_str)
        text = self._held + delta
        match = _first_match(text, self._stops)
        if match is not None:
            start, stop = match
            self._held, self._stop_str = "", stop
            end = start + len(stop) if self._include_stop else start
            return StopResult(text[:end], True, stop)
        keep = _partial_stop_len(text, self._stops)
        self._held = text[len(text) - keep :]
        return StopResult(text[: len(text) - keep], False, None)

    def flush(self) -> str:
        """Release held-back text at the end of the stream (nothing after a stop)."""
        held, self._held = self._held, ""
        return held


def _first_match(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Earliest stop in `text`; on a tie, the longest (it covers the shorter one)."""
    found = [(i, -len(s), s) for s in stops if (i := text.find(s)) >= 0]
    if not found:
        return None
    start, _, stop = min(found)
    return start, stop


def _partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
