"""Stop strings on streamed text: release text as soon as it cannot be the start of a stop string.

Owns only string logic (no tokenizer, no engine): `StopMatcher.push(piece)` returns the text that is safe
to send and whether a stop string appeared; text that might still grow into a stop string is held back,
so a client never receives any part of a stop string. serving/server/service.py cancels the engine request when
`stopped` becomes true.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...] | list[str] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.stopped = False

    def push(self, piece: str) -> tuple[str, bool]:
        """Feed the next piece of text; returns (text safe to release, stopped)."""
        if self.stopped:
            return "", True
        buf = self.held + piece
        if not self.stops:
            self.held = ""
            return buf, False
        cut = _first_match(buf, self.stops)
        if cut is not None:
            self.held, self.stopped = "", True
            return buf[:cut], True
        keep = _longest_partial(buf, self.stops)
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """At the end of the stream: the held text (it never became a stop string)."""
        held, self.held = self.held, ""
        return held

    def trim(self, text: str) -> str:
        """`text` cut before its first stop string (for answers that arrive whole, e.g. beam search)."""
        cut = _first_match(text, self.stops)
        return text if cut is None else text[:cut]


def _first_match(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _longest_partial(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
