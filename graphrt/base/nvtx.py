"""NVTX ranges on one domain, ``graphrt``, so that Nsight Systems names every phase of a step.

Off by default, and then free of NVTX: every helper returns ``NULL_RANGE``, a no-op context manager,
after one flag check, and the ``nvtx`` package is not even imported. On when ``configure`` is asked
to (``EngineConfig.nvtx`` / ``graphrt generate --nvtx``) or the environment says ``GRAPHRT_NVTX=1``,
and a tool such as ``nsys`` is attached: with no tool the ``nvtx`` package hands out a dummy domain,
and graphrt stays off rather than pay for calls nobody records.

A range's message is its name, optionally followed by a space and ``key=value`` details:

- ``load``: opening the checkpoint, building the model, filling its weights (engine init).
- ``step``: one ``LLMEngine.step``; ``schedule``, ``prefill``/``decode`` and ``sample`` nest in it.
- ``schedule``: choosing the step's sequences and KV blocks.
- ``prefill seqs=S tokens=T``: inputs, forward and logits of the step's S prompts (T new tokens).
- ``mixed seqs=S tokens=T batch=B``: a step whose S prompts' T new tokens and B decodes run in one
  forward (a mixed graph): ``decode.prepare`` and ``decode.replay ... prompt=C`` nest in it, then the
  ``sample`` of the prompts it finishes.
- ``decode batch=B``: the step's decode of B sequences (after its prefill, if any); holds one of:
- ``decode.prepare``: refreshing the static inputs of a CUDA graph, then
  ``decode.replay batch=B padded=P``: replaying the graph captured for padded batch P (a mixed graph's:
  ``decode.replay batch=B padded=P prompt=C``, C the prompt tokens' bucket); or
- ``decode.eager batch=B reason=R``: an eager decode, R saying why it is not a replay (the graph
  runner's ``EagerReason``: ``enforce_eager``, ``no_cuda``, ``capture_failed``, ``batch_too_large``,
  ``context_too_long``).
- ``decode.wait``: waiting for a decode step's sampled tokens to reach the host (inside ``decode``
  for a step that waits at once; inside ``step`` for a pipelined one, which waits for the step it
  launched the call before).
- ``sample``: sampling after an eager forward and its device-to-host copy (so it also shows the wait
  for the GPU); a decode graph samples inside the replay.
- ``capture bucket=P``: capturing the decode graph for padded batch P (``capture bucket=P prompt=C``: a
  mixed graph's).
- ``layer N``: decoder layer N (0-based) of a forward.

Per-layer ranges have their own switch (``layers``, ``GRAPHRT_NVTX_LAYERS=1``), which implies the
others; they cost one check per forward when off. A replayed CUDA graph runs no host code, so they
appear only in eager forwards and at capture.

Each distinct message gets its event attributes (a registered string and a colour) built once and
cached (at most ``MAX_CACHED_MESSAGES`` per kind, oldest dropped first), so a range on the hot path
costs a dict lookup plus the domain's push and pop. Use the helpers as context managers::

    from graphrt.base import nvtx
    with nvtx.decode(batch):
        with nvtx.decode_prepare():
            refresh_static_inputs()
        with nvtx.decode_replay(batch, padded):
            graph.replay()

NVTX state is per process: the last ``configure`` call wins.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

DOMAIN = "graphrt"
ENV_RANGES = "GRAPHRT_NVTX"
ENV_LAYERS = "GRAPHRT_NVTX_LAYERS"
#: Bound on the cached messages of one kind (e.g. distinct ``decode batch=B``); real engines stay far
#: below it, since batches and token counts are bounded by the scheduler's limits. (The ``nvtx``
#: package keeps every registered string for the process's life, as NVTX has no way to unregister.)
MAX_CACHED_MESSAGES = 4096
#: Ranges without details, built as soon as a tool is found so that no step pays for building them.
STATIC_NAMES = ("load", "step", "schedule", "decode.prepare", "decode.wait", "sample")

#: ARGB colours per range name, so phases are told apart at a glance on the timeline.
_COLORS = {
    "load": 0xFF7F7F7F,
    "step": 0xFF4C72B0,
    "schedule": 0xFF8172B2,
    "prefill": 0xFFC44E52,
    "decode": 0xFF55A868,
    "decode.prepare": 0xFFCCB974,
    "decode.replay": 0xFF64B5CD,
    "decode.wait": 0xFF8C8C8C,
    "decode.eager": 0xFFDD8452,
    "sample": 0xFF937860,
    "capture": 0xFFDA8BC3,
    "layer": 0xFFB0B0B0,
}


class _NullRange:
    """The range used when NVTX is off: entering and leaving it does nothing.

    Both hooks are ``"".format``, a C builtin that accepts any arguments and returns ``""``. A builtin
    stored on a class is not bound to the instance, so ``with`` calls it directly: no Python frame,
    cheaper than two ``def`` hooks; ``""`` is falsy, so exceptions propagate.
    """

    __slots__ = ()
    __enter__ = __exit__ = "".format


NULL_RANGE = _NullRange()


class _Range:
    """One message's pre-built event attributes; reusable and re-entrant (NVTX keeps the stack)."""

    __slots__ = ("attributes",)

    def __init__(self, attributes) -> None:
        self.attributes = attributes

    def __enter__(self) -> None:
        _push(self.attributes)

    def __exit__(self, exc_type, exc, traceback) -> bool:
        _pop()
        return False


_enabled = False
_layers = False
_domain = None  # nvtx.Domain once a tool was found
_push = _pop = None  # the domain's bound push_range / pop_range
#: Cached ranges, one dict per kind, keyed by the details' values.
_named: dict[str, _Range] = {}
_prefills: dict[tuple[int, int], _Range] = {}
_mixed: dict[tuple[int, int, int], _Range] = {}
_decodes: dict[int, _Range] = {}
_replays: dict[tuple[int, int, int], _Range] = {}
_eagers: dict[tuple[int, str], _Range] = {}
_captures: dict[tuple[int, int], _Range] = {}
_layer_ranges: dict[int, _Range] = {}


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def configure(enabled: bool = False, layers: bool = False) -> bool:
    """Turn ranges on when asked here or by the environment (``GRAPHRT_NVTX``, ``GRAPHRT_NVTX_LAYERS``)
    and a tool is attached; off otherwise. ``layers`` adds per-layer ranges and implies ``enabled``.
    Returns whether ranges are on."""
    global _enabled, _layers
    want_layers = layers or _env_flag(ENV_LAYERS)
    want = enabled or want_layers or _env_flag(ENV_RANGES)
    on = want and _attach()
    _enabled, _layers = on, on and want_layers
    return on


def _attach() -> bool:
    """Find the graphrt domain; False when the ``nvtx`` package is missing or no tool listens."""
    global _domain
    if _domain is not None:
        return True
    try:
        import nvtx
    except ImportError:
        logger.warning("NVTX ranges were asked for but the 'nvtx' package is not installed; ranges stay off")
        return False
    domain = nvtx.get_domain(DOMAIN)
    if not isinstance(domain, nvtx.Domain):  # the dummy domain: no tool attached
        logger.warning("NVTX ranges were asked for but no NVTX tool is attached (run under nsys); ranges stay off")
        return False
    _activate(domain)
    return True


def _activate(domain) -> None:
    """Use ``domain`` (an ``nvtx.Domain``, or a stand-in with the same three methods) from now on."""
    global _domain, _push, _pop
    _domain, _push, _pop = domain, domain.push_range, domain.pop_range
    for cache in (_named, _prefills, _mixed, _decodes, _replays, _eagers, _captures, _layer_ranges):
        cache.clear()
    for name in STATIC_NAMES:
        _build(_named, name, name)


def enabled() -> bool:
    """Whether ranges are emitted."""
    return _enabled


def layers_enabled() -> bool:
    """Whether per-layer ranges are emitted; models check it once per forward."""
    return _layers


def _build(cache: dict, key, message: str) -> _Range:
    """Build, cache and return the range for ``message``; the oldest entry goes when ``cache`` is full."""
    if len(cache) >= MAX_CACHED_MESSAGES:
        del cache[next(iter(cache))]
    color = _COLORS.get(message.split(" ", 1)[0])
    built = cache[key] = _Range(_domain.get_event_attributes(message=message, color=color))
    return built


# -- ranges ----------------------------------------------------------------------------------------
# Each helper checks the flag first, so when off it neither formats a message nor touches NVTX.


def range(name: str):  # noqa: A001 - NVTX's own word for it
    """A range without details: ``load``, ``step``, ``schedule``, ``decode.prepare``, ``decode.wait``,
    ``sample``."""
    if not _enabled:
        return NULL_RANGE
    found = _named.get(name)
    return found if found is not None else _build(_named, name, name)


def prefill(num_seqs: int, num_tokens: int):
    """``prefill seqs=S tokens=T``: an eager forward over S prompts' T new tokens."""
    if not _enabled:
        return NULL_RANGE
    key = (num_seqs, num_tokens)
    found = _prefills.get(key)
    if found is not None:
        return found
    return _build(_prefills, key, f"prefill seqs={num_seqs} tokens={num_tokens}")


def mixed(num_seqs: int, num_tokens: int, batch: int):
    """``mixed seqs=S tokens=T batch=B``: one forward over S prompts' T new tokens and B decodes."""
    if not _enabled:
        return NULL_RANGE
    key = (num_seqs, num_tokens, batch)
    found = _mixed.get(key)
    if found is not None:
        return found
    return _build(_mixed, key, f"mixed seqs={num_seqs} tokens={num_tokens} batch={batch}")


def decode(batch: int):
    """``decode batch=B``: a decode-only step of B sequences."""
    if not _enabled:
        return NULL_RANGE
    found = _decodes.get(batch)
    return found if found is not None else _build(_decodes, batch, f"decode batch={batch}")


def decode_prepare():
    """``decode.prepare``: refreshing the static inputs of a graph before replay."""
    return range("decode.prepare")


def decode_wait():
    """``decode.wait``: waiting for a decode step's sampled tokens."""
    return range("decode.wait")


def decode_replay(batch: int, padded: int, prompt_tokens: int = 0):
    """``decode.replay batch=B padded=P``: replaying bucket P's graph for B real sequences; a mixed graph's,
    with C prompt tokens before them: ``decode.replay batch=B padded=P prompt=C``."""
    if not _enabled:
        return NULL_RANGE
    key = (batch, padded, prompt_tokens)
    found = _replays.get(key)
    if found is not None:
        return found
    prompt = f" prompt={prompt_tokens}" if prompt_tokens else ""
    return _build(_replays, key, f"decode.replay batch={batch} padded={padded}{prompt}")


def decode_eager(batch: int, reason: str):
    """``decode.eager batch=B reason=R``: an eager decode forward and why it is not a replay."""
    if not _enabled:
        return NULL_RANGE
    key = (batch, reason)
    found = _eagers.get(key)
    return found if found is not None else _build(_eagers, key, f"decode.eager batch={batch} reason={reason}")


def capture(bucket: int, prompt_tokens: int = 0):
    """``capture bucket=P``: capturing the decode graph for padded batch P (``capture bucket=P prompt=C``:
    a mixed graph's, with C prompt tokens)."""
    if not _enabled:
        return NULL_RANGE
    key = (bucket, prompt_tokens)
    found = _captures.get(key)
    if found is not None:
        return found
    return _build(_captures, key, f"capture bucket={bucket}" + (f" prompt={prompt_tokens}" if prompt_tokens else ""))


def layer(index: int):
    """``layer N``: decoder layer N. Callers check ``layers_enabled()`` once per forward instead of
    calling this per layer when off."""
    if not _layers:
        return NULL_RANGE
    found = _layer_ranges.get(index)
    return found if found is not None else _build(_layer_ranges, index, f"layer {index}")
