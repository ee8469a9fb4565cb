"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of a sequence's newest
n-gram, from its own prompt and output (no model). An index per sequence keeps each lookup O(n)."""

from __future__ import annotations


class NgramIndex:
    """For each n in [min_n, max_n], the latest start of every n-gram of ``tokens`` that some token
    follows. ``extend`` indexes appended tokens; ``propose`` looks the newest n-grams up, longest first."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._starts: dict[tuple[int, ...], int] = {}  # n-gram -> latest start with a follower

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending just before ``token`` now have a follower
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._starts[tuple(self.tokens[end - n:end])] = end - n
            self.tokens.append(token)

    def propose(self, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` tokens: those that followed the newest n-gram's latest earlier occurrence
        (longest n first), and where that continuation reaches the end of the tokens, the lookup again
        with the draft so far appended (a repeating pattern drafts as far as asked); [] when no n-gram
        of the end occurred before."""
        tokens, draft = self.tokens, []
        while len(draft) < num_tokens:
            tail = (tokens[-self.max_n:] + draft)[-self.max_n:]
            for n in range(len(tail), self.min_n - 1, -1):
                start = self._starts.get(tuple(tail[len(tail) - n:]))
                if start is not None:  # indexed n-grams have a follower: the continuation is not empty
                    draft += tokens[start + n:start + n + num_tokens - len(draft)]
                    break
            else:
                break
        return draft
