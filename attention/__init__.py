"""Attention backends for graphrt: the interface, per-step metadata and the registry of backends."""

from __future__ import annotations

import torch

from graphrt.attention.backend import AttentionBackend, AttentionImpl
from graphrt.attention.metadata import AttentionMetadata
from graphrt.attention.reference import ReferenceAttentionBackend
from graphrt.attention.triton_backend import TritonAttentionBackend

#: Every backend graphrt ships, by name, in order of preference.
BACKENDS: dict[str, type[AttentionBackend]] = {
    TritonAttentionBackend.name: TritonAttentionBackend,
    ReferenceAttentionBackend.name: ReferenceAttentionBackend,
}


def get_attention_backend(name: str | None, device: torch.device) -> type[AttentionBackend]:
    """The backend called ``name``, or the first usable one on ``device`` when name is None."""
    if name is None:
        for backend in BACKENDS.values():
            if backend.unusable_reason(device) is None:
                return backend
        raise RuntimeError(f"no attention backend can run on {device}")
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
    backend = BACKENDS[name]
    reason = backend.unusable_reason(device)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} cannot run on {device}: {reason}")
    return backend


__all__ = [
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadata",
    "BACKENDS",
    "ReferenceAttentionBackend",
    "TritonAttentionBackend",
    "get_attention_backend",
]
