"""Text that may be sent: cut at the first stop string, and never a character that could
turn out to start one (a block's text is final, but a stop string may span blocks)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class StopText:
    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) - 1 for s in stops), default=0)
        self.text = ""
        self.sent = 0
        self.stopped = False

    def feed(self, delta: str, final: bool = False) -> str:
        """Adds newly complete text; returns what may be sent now."""
        if self.stopped:
            return ""
        self.text += delta
        start = max(0, self.sent - self.hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            final = True
        upto = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent : upto]
        self.sent = upto
        return out


def tokens_spelling(decode: Callable[[Sequence[int]], str], ids: Sequence[int], chars: int) -> int:
    """The fewest leading `ids` whose text has at least `chars` characters: how many of
    a completion's tokens its text, cut by a stop string, kept (a binary search, so a
    long completion costs a few decodes of its prefixes)."""
    low, high = 0, len(ids)
    while low < high:
        mid = (low + high) // 2
        if len(decode(ids[:mid])) >= chars:
            high = mid
        else:
            low = mid + 1
    return low
