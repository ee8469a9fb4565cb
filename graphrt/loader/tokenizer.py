"""Text <-> token ids and chat-template rendering, over a ``tokenizers.Tokenizer``.

Two sources: an HF model directory (``tokenizer.json`` + ``tokenizer_config.json``) and the
metadata of a GGUF file (vocabulary, merges or scores, and special ids under ``tokenizer.ggml.*``),
which carries no ``tokenizer.json`` and so has its tokenizer rebuilt here: byte-level BPE
(``tokenizer.ggml.model = "gpt2"``: SmolLM2, Llama 3, Qwen2) or SentencePiece BPE (``"llama"``:
Llama 2, Mistral, TinyLlama). The latter encodes as HF's sentencepiece-backed Llama tokenizer and
llama.cpp do, and on text without added tokens as SentencePiece itself: a "▁" prefix on each stretch
of text between added tokens, merges ranked by the pieces' scores, and characters outside the
vocabulary as ``<0xNN>`` byte tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from graphrt.base.errors import GraphrtError, InvalidRequestError, ModelLoadError
from graphrt.loader.token_bytes import token_bytes

if TYPE_CHECKING:
    import gguf

# llama.cpp's token_type values (llama_token_type in llama.h).
_NORMAL = 1
_UNKNOWN = 2
_CONTROL = 3
_USER_DEFINED = 4

#: What SentencePiece writes for a space, in its pieces and in the text it tokenizes.
_SPACE_PIECE = "\u2581"

# GPT-2's split with Llama 3's changes: case-insensitive contractions, a leading non-letter glued
# to a word, digits in groups of at most three, newlines kept apart from other whitespace.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's: as Llama 3's, but every digit on its own.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre() -> pre_tokenizers.PreTokenizer:
    # ByteLevel's own regex is GPT-2's split.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_pre() -> pre_tokenizers.PreTokenizer:
    # SmolLM/StarCoder: every digit isolated first, then GPT-2's split on each piece. This is both
    # llama.cpp's `smollm` rule (regexes "\p{N}" then GPT-2's) and the original tokenizer.json.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()])


def _split_pre(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        # The regex does the splitting, so ByteLevel only maps bytes to its alphabet.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return build


class _PreRule(NamedTuple):
    """How llama.cpp treats a ``tokenizer.ggml.pre`` type, matching the original tokenizer.json."""

    build: Callable[[], pre_tokenizers.PreTokenizer]
    #: A pre-token that is itself in the vocabulary is taken whole, merges or not (Llama 3).
    ignore_merges: bool = False
    #: Whether BOS is prepended when the file has no ``tokenizer.ggml.add_bos_token``.
    add_bos: bool = False


_LLAMA3_RULE = _PreRule(_split_pre(_LLAMA3_SPLIT), ignore_merges=True, add_bos=True)

#: ``tokenizer.ggml.pre`` value -> its rule.
_GGUF_PRE_RULES: dict[str, _PreRule] = {
    "default": _PreRule(_gpt2_pre),
    "gpt2": _PreRule(_gpt2_pre),
    "smollm": _PreRule(_digits_then_gpt2_pre),
    "starcoder": _PreRule(_digits_then_gpt2_pre),
    "llama-bpe": _LLAMA3_RULE,
    "llama3": _LLAMA3_RULE,
    "llama-v3": _LLAMA3_RULE,
    "qwen2": _PreRule(_split_pre(_QWEN2_SPLIT)),
}


def _byte_level_bpe(
    reader: gguf.GGUFReader, tokens: list[str], token_types: list[int]
) -> tuple[BackendTokenizer, bool]:
    """A ``gpt2`` vocabulary's backend, its added tokens not yet added, and whether its pre-tokenizer
    type adds BOS when the file does not say."""
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in _GGUF_PRE_RULES:
        raise ModelLoadError(
            f"GGUF pre-tokenizer {pre!r} is not supported; graphrt knows {', '.join(sorted(_GGUF_PRE_RULES))}"
        )
    rule = _GGUF_PRE_RULES[pre]
    # A merge is "left right"; neither side can hold a space, which byte-level spells as "Ġ".
    bpe = models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=_merges(reader) or [],
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=rule.ignore_merges,
    )
    backend = BackendTokenizer(bpe)
    backend.pre_tokenizer = rule.build()
    backend.decoder = decoders.ByteLevel()
    return backend, rule.add_bos


def _sentencepiece_bpe(
    reader: gguf.GGUFReader, tokens: list[str], token_types: list[int]
) -> tuple[BackendTokenizer, bool]:
    """A ``llama`` (SentencePiece BPE) vocabulary's backend, its added tokens not yet added, and
    True: BOS is added when the file does not say, as llama.cpp and HF do.

    Text takes SentencePiece's spelling first: "▁" for each space and, with ``add_space_prefix`` (on
    unless the file says otherwise), one more in front of each stretch of text between added tokens,
    even one that starts with a space. Each such stretch is one word for the BPE model, whose merges
    are the file's or, usually, derived from the scores; a character outside the vocabulary becomes
    the ``<0xNN>`` tokens of its UTF-8 bytes. Decoding reverses this and drops the prefix's space.
    """
    scores = _array(reader, "tokenizer.ggml.scores", _FLOAT32S, len(tokens))
    if scores is None:
        raise ModelLoadError(
            "GGUF tokenizer model 'llama' (SentencePiece) needs tokenizer.ggml.scores, which the file lacks"
        )
    merges = _merges(reader)
    bpe = models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=merges if merges else _merges_by_score(tokens, token_types, scores),
        unk_token=_special_token(reader, "tokenizer.ggml.unknown_token_id", tokens),
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = BackendTokenizer(bpe)
    add_space_prefix = _flag(reader, "tokenizer.ggml.add_space_prefix", True)
    prefix = [normalizers.Prepend(_SPACE_PIECE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", _SPACE_PIECE)])
    strip_prefix = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip_prefix]
    )
    return backend, True


def _merges_by_score(tokens: list[str], token_types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """(left, right) merges, best first, that make BPE encode as SentencePiece does from scores.

    SentencePiece BPE keeps joining the adjacent pair whose join is the best-scored piece, so every
    cut of a piece into two pieces is a merge ranked by that piece's score (ties: the piece listed
    first). Only normal pieces (token_type 1) take part: control, unknown and user-defined tokens are
    matched whole before the model runs, byte tokens are not spelled by the text they stand for, and
    unused pieces are never output.
    """
    normal = {token: i for i, (token, kind) in enumerate(zip(tokens, token_types)) if kind == _NORMAL}
    ranked = []
    for piece, index in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[index], index, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


class _GGUFModel(NamedTuple):
    """How a ``tokenizer.ggml.model`` type is rebuilt."""

    #: (reader, tokens, token_types) -> (backend before added tokens, whether BOS is added by default).
    build: Callable[[gguf.GGUFReader, list[str], list[int]], tuple[BackendTokenizer, bool]]
    #: token_types that become special added tokens (skipped by ``decode(skip_special_tokens=True)``).
    special_types: frozenset[int]


#: ``tokenizer.ggml.model`` value -> how it is rebuilt.
_GGUF_MODELS: dict[str, _GGUFModel] = {
    "gpt2": _GGUFModel(_byte_level_bpe, frozenset({_CONTROL})),
    # HF's Llama tokenizer makes <unk> special, so it is skipped in decoding and matched whole in text.
    "llama": _GGUFModel(_sentencepiece_bpe, frozenset({_CONTROL, _UNKNOWN})),
}


class TextStream:
    """The text of a list of token ids that grows at its end (a request's output while it decodes):
    ``text_of(ids)`` decodes only the ids added since the last call (``tokenizers``'
    ``DecodeStream``, which holds back a character whose UTF-8 bytes span ids not all there yet), so a
    step costs its new tokens, not the whole text. Where a tokenizer's decoding of a whole list differs
    from the concatenation of its parts (clean-up of spaces around punctuation, a leading space), the
    whole list's decoding is the reference: ``Tokenizer.decode``. Where the stream cannot go on (byte
    fallback ids that do not form UTF-8 make ``DecodeStream`` raise), the text is the whole list's
    decoding from then on, so it may then change in its last characters as ids arrive."""

    def __init__(self, backend: BackendTokenizer, skip_special_tokens: bool = True) -> None:
        self._backend, self._skip_special_tokens = backend, skip_special_tokens
        self._stream: decoders.DecodeStream | None = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
        self._decoded = 0
        self.text = ""

    def text_of(self, ids: list[int]) -> str:
        """The text of ``ids``: the ids given before, then new ones (the earlier ones are not re-read)."""
        if self._stream is not None:
            try:
                for token_id in ids[self._decoded:]:
                    chunk = self._stream.step(self._backend, token_id)
                    if chunk:
                        self.text += chunk
                    self._decoded += 1
                return self.text
            except Exception:  # the tokenizers library raises a bare Exception for an undecodable prefix
                self._stream = None
        self.text = self._backend.decode(list(ids), skip_special_tokens=self._skip_special_tokens)
        self._decoded = len(ids)
        return self.text


class Tokenizer:
    """Encodes text to token ids (``list[int]``) and back, and renders chat templates.

    ``encode`` never runs the backend's post-processor: the special tokens a prompt gets, BOS first
    and (for the few GGUF files that ask) EOS last, are added here when ``add_bos_token`` and
    ``add_eos_token`` say so, whatever the source.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_tokens: tuple[str, ...] = (),
        chat_template: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
    ) -> None:
        self._backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        ids = (backend.token_to_id(t) for t in eos_tokens)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in ids if i is not None))
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token and self.bos_token_id is not None
        self.add_eos_token = add_eos_token and bool(self.eos_token_ids)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (may be below the model's padded embedding rows)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    # ------------------------------------------------------------------ sources

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer | None:
        """Read ``tokenizer.json`` from an HF model directory; None when the directory has none.

        Like transformers 5, whether BOS is prepended follows ``tokenizer.json``'s post-processor;
        ``tokenizer_config.json``'s ``add_bos_token`` counts only when there is no post-processor.
        """
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            return None
        try:
            backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # the Rust side raises a bare Exception on malformed JSON
            raise ModelLoadError(f"{path / 'tokenizer.json'} cannot be read: {exc}") from None
        config = _read_json(path / "tokenizer_config.json") or {}
        bos = _token_text(config.get("bos_token"))
        eos = _token_text(config.get("eos_token"))
        if backend.post_processor is not None and bos is not None:
            probe = backend.encode("", add_special_tokens=True).ids
            add_bos = bool(probe) and probe[0] == backend.token_to_id(bos)
        else:
            add_bos = bool(config.get("add_bos_token", False))
        return cls(
            backend,
            bos_token=bos,
            eos_tokens=(eos,) if eos is not None else (),
            chat_template=_hf_chat_template(path, config),
            add_bos_token=add_bos,
        )

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes in ``tokenizer.ggml.*``: byte-level BPE
        (``tokenizer.ggml.model`` ``"gpt2"``) or SentencePiece BPE (``"llama"``).

        Control tokens (token_type 3, e.g. ``<|im_start|>``, ``</s>``) become special added tokens
        and user-defined ones (type 4) plain added tokens, so each is matched whole in text; in a
        SentencePiece vocabulary the unknown token (type 2, ``<unk>``) is special too, as in HF.
        Raises ModelLoadError for another tokenizer model, an unknown pre-tokenizer, or tokenizer
        metadata that is missing, of the wrong type or length, or names an id outside the vocabulary.
        """
        model = _field(reader, "tokenizer.ggml.model")
        if model is None:
            raise ModelLoadError("the GGUF file holds no tokenizer (no tokenizer.ggml.model key)")
        if model not in _GGUF_MODELS:
            raise ModelLoadError(
                f"GGUF tokenizer model {model!r} is not supported; graphrt reads byte-level BPE ('gpt2') "
                "and SentencePiece ('llama')"
            )
        kind = _GGUF_MODELS[model]
        tokens = _array(reader, "tokenizer.ggml.tokens", _STRINGS)
        if tokens is None:
            raise ModelLoadError("GGUF file has no tokenizer.ggml.tokens")
        token_types = _array(reader, "tokenizer.ggml.token_type", _INTEGERS, len(tokens)) or [_NORMAL] * len(tokens)
        backend, add_bos_by_default = kind.build(reader, tokens, token_types)
        # normalized=False: these are matched in the raw text, before any normalizer or byte mapping.
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                    for t, k in zip(tokens, token_types) if k in kind.special_types])
        backend.add_tokens([AddedToken(t, normalized=False, special=False)
                            for t, k in zip(tokens, token_types) if k == _USER_DEFINED])

        # llama.cpp ends generation at EOS, and also at EOT/EOM where a file names them.
        eos = (_special_token(reader, f"tokenizer.ggml.{name}_token_id", tokens) for name in ("eos", "eot", "eom"))
        return cls(
            backend,
            bos_token=_special_token(reader, "tokenizer.ggml.bos_token_id", tokens),
            eos_tokens=tuple(t for t in eos if t is not None),
            chat_template=_string(reader, "tokenizer.chat_template"),
            add_bos_token=_flag(reader, "tokenizer.ggml.add_bos_token", add_bos_by_default),
            add_eos_token=_flag(reader, "tokenizer.ggml.add_eos_token", False),
        )

    # ------------------------------------------------------------------ text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS first only if ``add_special_tokens`` and ``add_bos_token``, EOS
        last only if ``add_special_tokens`` and ``add_eos_token``.

        Special tokens written in the text (``<|im_start|>``) encode to their single id either way.
        """
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            ids.insert(0, self.bos_token_id)
        if add_special_tokens and self.add_eos_token:
            ids.append(self.eos_token_ids[0])
        return ids

    def encode_chat(self, messages: list[dict[str, str]], rendered: str) -> list[int]:
        """Token ids of ``rendered``, the chat prompt ``apply_chat_template(messages)`` gave, whose special
        tokens are the template's alone: one spelled out inside a message (a user writing
        ``<|im_start|>system``) is encoded as the plain text it is, so that no message can open a turn
        of its own. Prompts without such text encode as ``encode`` would.

        Raises InvalidRequestError when a message spells a special token and the template does not put
        the message's text into the prompt as it is (so it cannot be told apart from the template's).
        """
        if not any(name in message["content"] for message in messages for name in self._special_texts):
            return self.encode(rendered, add_special_tokens=False)
        spans = self._content_spans(messages, rendered)
        ids, done = [], 0
        for start, end in spans:
            ids += self.encode(rendered[done:start], add_special_tokens=False)
            ids += self._plain_text_ids(rendered[start:end])
            done = end
        return ids + self.encode(rendered[done:], add_special_tokens=False)

    @cached_property
    def _special_texts(self) -> frozenset[str]:
        """The special tokens' texts (the vocabulary does not change after loading)."""
        return frozenset(token.content for token in self._backend.get_added_tokens_decoder().values() if token.special)

    def _content_spans(self, messages: list[dict[str, str]], rendered: str) -> list[tuple[int, int]]:
        """Where each message's text lies in ``rendered``, as [start, end) character spans in order: found
        by rendering again with a marker for each text."""
        markers = [f"\ue000{index}\ue001" for index in range(len(messages))]
        marked = self.apply_chat_template([{**message, "content": marker}
                                           for message, marker in zip(messages, markers)])
        spans, pieces, done, shift = [], [], 0, 0
        for message, marker in zip(messages, markers):
            at = marked.find(marker, done)
            if at < 0 or marked.count(marker) != 1:
                break
            pieces += [marked[done:at], message["content"]]
            start = at + shift
            spans.append((start, start + len(message["content"])))
            shift += len(message["content"]) - len(marker)
            done = at + len(marker)
        if len(spans) != len(messages) or "".join(pieces) + marked[done:] != rendered:
            raise InvalidRequestError("a message holds the text of a special token, and this model's chat template "
                                      "changes message texts, so it cannot be kept as plain text: remove it")
        return spans

    def _plain_text_ids(self, text: str) -> list[int]:
        """``text``'s ids with the special tokens it spells encoded as ordinary text."""
        self._backend.encode_special_tokens = True
        try:
            return self._backend.encode(text, add_special_tokens=False).ids
        finally:
            self._backend.encode_special_tokens = False

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; an incomplete UTF-8 sequence decodes to U+FFFD, as in HF."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (part of a character, for some byte-level tokens);
        a special token's are its text's."""
        return token_bytes(self._backend.id_to_token(token_id),
                           self._backend.decode([token_id], skip_special_tokens=False))

    def text_stream(self, skip_special_tokens: bool = True) -> TextStream:
        """A ``TextStream``: the text of a growing list of ids, each new id decoded on its own."""
        return TextStream(self._backend, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (``{"role": ..., "content": ...}``) with the model's chat template.

        Returns text that already holds its special tokens: encode it with ``add_special_tokens=False``.
        Raises GraphrtError when the model has no template and InvalidRequestError when the template
        rejects the messages (its ``raise_exception``).
        """
        if self.chat_template is None:
            raise GraphrtError("model has no chat template")
        template = _compile_template(self.chat_template)
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template rejected the messages: {exc}") from None


# ---------------------------------------------------------------------- chat templates


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & for HTML; chat templates (and HF) want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    # Templates come with downloaded models, so they run sandboxed: no attribute tricks, no mutation
    # of the objects they are given. trim_blocks/lstrip_blocks are what HF renders with.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(f"the model's chat template does not parse: {exc}") from None


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    # transformers gives a separate chat_template.jinja priority over tokenizer_config.json.
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None:
        template = (_read_json(path / "chat_template.json") or {}).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


# ---------------------------------------------------------------------- helpers


def _read_json(file: Path) -> dict[str, Any] | None:
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{file} is not valid JSON: {exc}") from None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or a serialised AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


class _ItemType(NamedTuple):
    """The GGUF value types an array's items may have."""

    #: As an error message calls them.
    description: str
    #: ``gguf.GGUFValueType`` member names.
    gguf_names: frozenset[str]


_STRINGS = _ItemType("strings", frozenset({"STRING"}))
_FLOAT32S = _ItemType("float32 numbers", frozenset({"FLOAT32"}))
_INTEGERS = _ItemType("integers", frozenset({"UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64"}))


def _array(reader: gguf.GGUFReader, key: str, items: _ItemType, length: int | None = None) -> list[Any] | None:
    """The array stored under ``key`` as a list, or None when the file has no such key.

    Raises ModelLoadError when the value is not an array of ``items`` or, given ``length`` (the
    number of tokens), holds another number of entries.
    """
    field = reader.get_field(key)
    if field is None:
        return None
    types = [t.name for t in field.types]
    if types[0] != "ARRAY" or types[-1] not in items.gguf_names:
        raise ModelLoadError(f"{key} must be an array of {items.description}, not {' of '.join(types)}")
    values = field.contents()
    if length is not None and len(values) != length:
        raise ModelLoadError(f"{key} holds {len(values)} entries for {length} tokens")
    return values


def _merges(reader: gguf.GGUFReader) -> list[tuple[str, str]] | None:
    """``tokenizer.ggml.merges`` as (left, right) pairs, None when absent; ModelLoadError for an entry that
    is not two pieces joined by one space."""
    merges = _array(reader, "tokenizer.ggml.merges", _STRINGS)
    if merges is None:
        return None
    pairs = [tuple(merge.split(" ")) for merge in merges]
    bad = next((merge for merge, pair in zip(merges, pairs) if len(pair) != 2 or not all(pair)), None)
    if bad is not None:
        raise ModelLoadError(f"tokenizer.ggml.merges holds {bad!r}, not two pieces joined by one space")
    return pairs


def _string(reader: gguf.GGUFReader, key: str) -> str | None:
    """The string stored under ``key``, None when absent; ModelLoadError for another type."""
    value = _field(reader, key)
    if value is not None and not isinstance(value, str):
        raise ModelLoadError(f"{key} must be a string, not {value!r}")
    return value


def _flag(reader: gguf.GGUFReader, key: str, default: bool) -> bool:
    """The boolean stored under ``key``, ``default`` when absent; ModelLoadError for another type."""
    value = _field(reader, key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ModelLoadError(f"{key} must be a boolean, not {value!r}")
    return value


def _special_token(reader: gguf.GGUFReader, key: str, tokens: list[str]) -> str | None:
    """The token whose id is stored under ``key``, None when absent; ModelLoadError for an id
    outside ``tokens``."""
    index = _field(reader, key)
    if index is None:
        return None
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(tokens):
        raise ModelLoadError(f"{key} is {index!r}, not an id in the vocabulary of {len(tokens)} tokens")
    return tokens[index]
