"""Stop strings: text that ends a request when its output contains it (``SamplingParams.stop``).

Tokens do not line up with characters, so a stop string is looked for in the output's text after each
step. The output's text stops where the first stop string begins (the stop string itself is not part
of it, as in OpenAI's API); its token ids keep every token generated. While a request runs, the end of
its text that could be the beginning of a stop string is held back, so that text already returned
never has to be taken back.
"""

from __future__ import annotations


class StopStrings:
    """Watches one request's growing output text for its stop strings.

    ``stops``: non-empty strings. ``found(text)`` is called with the text so far after each step
    (each call's text extends the previous call's); it searches only what is new, plus the characters
    a stop string could straddle.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = list(stops)
        self._longest = max(map(len, self.stops))
        self._searched = 0  # characters of the text searched by earlier calls

    def found(self, text: str) -> bool:
        """Whether ``text`` contains a stop string."""
        start = max(0, self._searched - self._longest + 1)
        self._searched = len(text)
        return any(text.find(stop, start) >= 0 for stop in self.stops)

    def cut(self, text: str) -> str:
        """A finished request's text: ``text`` up to its first stop string (all of it without one)."""
        hits = [index for stop in self.stops if (index := text.find(stop)) >= 0]
        return text[:min(hits)] if hits else text

    def safe_prefix(self, text: str) -> str:
        """A running request's text: ``text`` less its longest ending that begins some stop string
        (which the next tokens may complete)."""
        for start in range(max(0, len(text) - self._longest + 1), len(text)):
            tail = text[start:]
            if any(stop.startswith(tail) for stop in self.stops):
                return text[:start]
        return text
