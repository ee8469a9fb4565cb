"""The bytes a single token stands for, where its text alone cannot say: a byte-level BPE token (GPT-2's
spelling of bytes as printable characters) or a SentencePiece byte-fallback token (``<0xE2>``) may hold
part of a character, which decodes to U+FFFD on its own."""

from __future__ import annotations

import re
from functools import lru_cache

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE_PIECE = "\u2581"


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's spelling, inverted: the printable Latin-1 bytes stand for themselves; each other
    byte, in order, for the character 256 + its rank among them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    kept = set(printable)
    others = [byte for byte in range(256) if byte not in kept]
    spelling = {byte: chr(byte) for byte in printable}
    spelling.update({byte: chr(256 + rank) for rank, byte in enumerate(others)})
    return {char: byte for byte, char in spelling.items()}


def token_bytes(piece: str | None, decoded: str) -> bytes:
    """The bytes of a token whose vocabulary entry is ``piece`` and whose text decoded alone is ``decoded``.

    A text without U+FFFD is the token's (UTF-8). Otherwise the entry says: ``<0xNN>`` is byte NN; an
    entry of byte-level characters maps back through the spelling; a SentencePiece entry is its text
    with "\u2581" for spaces. Failing all of these, the decoded text's bytes."""
    if "\ufffd" not in decoded or piece is None:
        return decoded.encode()
    fallback = _BYTE_FALLBACK.fullmatch(piece)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    byte_of = _byte_of_char()
    if all(char in byte_of for char in piece):
        return bytes(byte_of[char] for char in piece)
    return piece.replace(_SPACE_PIECE, " ").encode()


def token_label(data: bytes) -> str:
    """A token's text for an API answer: its bytes as UTF-8 when they are, else ``bytes:\\xNN...`` (the
    spelling OpenAI uses for a token holding part of a character)."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)
