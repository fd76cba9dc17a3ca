"""Stochastic-rounding streams: the random bits of a model's gradient casts belong to its weights.

A compiled model's stochastic gradient casts (``Config.grad_stochastic_rounding``) draw their seeds
from streams of its own, not from torch's global generator, so two models trained in one process
(threads, or interleaved steps) each get the bits they would get alone. Each FP8 weight whose
gradient is cast stochastically has one stream: an int64 tensor ``[key, draws]`` on the weight's device.
A backward takes ``seed = mix(key, draws)`` (31 bits) for each of its stochastic gradient casts (one;
two for MX, whose backward casts the gradient blocked both ways, and for NVFP4, dgrad and wgrad) and
advances ``draws`` as much, all on the device in one launch (``fp8pass::sr_draw_``), no host
synchronisation. The keys come from ``Config.sr_seed``
and the order in which the model's compiled graphs first meet its FP8 weights (:func:`stream_key`),
so the same model, config and seed give the same streams in any process.

The stream travels with the scaling state: ``"<param FQN>.fp8_sr.stream"`` in ``model.state_dict()``
(single-file and DCP checkpoints alike) and ``"<param FQN>.sr.stream"`` in
:func:`fp8pass.scaling_state_dict`, so a resumed run continues each stream where it stopped.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from ..kernels import uses_triton
from .casting import resolve_format

__all__ = ["SRStream", "stream_for", "stream_key", "draw_seed", "draws_per_backward", "seed_of", "mix_seed",
           "KEY_LIMIT", "MAX_DRAWS", "SR_FIELDS"]

KEY_LIMIT = 2**31  # keys and seeds are 31-bit: the casts' seeds (Philox keys, int32 on the CPU path)
SR_FIELDS = ("stream",)


def stream_key(sr_seed: int, ordinal: int) -> int:
    """The key of the ``ordinal``-th stream of a model under ``sr_seed``: a hash, so nearby seeds and
    ordinals give unrelated keys (a stream's seeds never replay another's shifted by a few steps)."""
    digest = hashlib.blake2b(f"fp8pass-sr:{int(sr_seed)}:{int(ordinal)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % KEY_LIMIT


def mix_seed(key: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """The 31-bit seed of draw ``draws`` of the stream ``key`` (int64 tensors; elementwise, torch ops).

    A 32-bit integer hash of ``key`` and the draw count (every product stays below 2**63, so int64
    arithmetic never wraps); the Triton launcher (``triton_helpers.stream_seed``) computes the same bits.
    """
    m = 0xFFFFFFFF
    h = (key * 0x27D4EB2D + (draws & m) * 0x165667B1 + 0x3C6EF372) & m
    h = (((h >> 16) ^ h) * 0x45D9F3B) & m
    h = (((h >> 16) ^ h) * 0x45D9F3B) & m
    return ((h >> 16) ^ h) & (KEY_LIMIT - 1)


MAX_DRAWS = 2  # seeds one sr_draw_ gives at most: an MX or NVFP4 backward casts the gradient twice


# Declared directly, not with knob_op: it has no recipe knobs, only a per-call count with a default.
@torch.library.custom_op("fp8pass::sr_draw_", mutates_args=("stream",))
def sr_draw_(stream: torch.Tensor, n: int = 1) -> torch.Tensor:
    """The seeds (int64 [n]) of the stream's next ``n`` draws; advances ``stream[1]`` by ``n`` in place
    (on the device; ``n`` in 1..``MAX_DRAWS``)."""
    if not 1 <= n <= MAX_DRAWS:
        raise ValueError(f"sr_draw_: n must be in [1, {MAX_DRAWS}], got {n}")
    if uses_triton(stream.device) and type(stream) is torch.Tensor:
        from ..kernels import triton_helpers

        return triton_helpers.stream_seed(stream, n)  # one launch: the seeds and the advance
    draws = stream[1:2] if n == 1 else stream[1:2] + torch.arange(n, device=stream.device)
    seed = mix_seed(stream[0:1], draws)
    stream[1:2].add_(n)
    return seed


@sr_draw_.register_fake
def _(stream, n=1):
    return stream.new_empty(n)


def draws_per_backward(granularity: str) -> int:
    """Seeds a dense linear's stochastic backward takes: MX casts the gradient twice (blocked along
    each GEMM's reduction dim, ``runtime.linear``), every other granularity once."""
    return 2 if granularity == "mx" else 1


def draw_seed(stream: torch.Tensor | None, grad_rounding: str, bwd_format: str, n: int = 1) -> torch.Tensor | None:
    """The seeds (int64 [n]) for a backward's ``n`` stochastic gradient casts from ``stream``; None
    where the casts round to nearest, are the identity, or have no stream (then they draw from
    torch's generator)."""
    if stream is None or grad_rounding != "stochastic" or resolve_format(bwd_format) is None:
        return None
    return torch.ops.fp8pass.sr_draw_(stream, n)


def seed_of(seeds: torch.Tensor | None, i: int) -> torch.Tensor | None:
    """Seed ``i`` (int64 [1], a view) of a backward's seeds, None without; a backward that needs more
    seeds than it was given refuses (a reused seed would correlate two casts' rounding)."""
    if seeds is None:
        return None
    if seeds.numel() <= i:
        raise ValueError(f"this backward casts the gradient {i + 1} times and needs {i + 1} stochastic-rounding "
                         f"seeds (sr_draw_(stream, {i + 1})), got {seeds.numel()}")
    return seeds[i:i + 1]


@dataclass
class SRStream:
    """The stochastic-rounding stream of one weight: ``stream`` int64 ``[key, draws]``."""

    stream: torch.Tensor

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"sr.stream": self.stream.detach().clone()}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy a validated ``{"sr.stream": t}`` into the live tensor (graphs keep reading the same one)."""
        with torch.no_grad():
            self.stream.copy_(sd["sr.stream"].to(self.stream.device))


_REGISTRY = WeakTensorKeyDictionary()  # weight -> SRStream; keyed by identity, freed with the weight


def stream_for(weight: torch.Tensor, key=None) -> SRStream:
    """The stream of ``weight``, created on first use with ``key`` (an int, or a callable giving one:
    a model's next key is taken only when a stream is really made); follows the weight's device."""
    st = _REGISTRY.get(weight)
    if st is None:
        if key is None:
            raise ValueError("stream_for: a weight without a stochastic-rounding stream needs a key")
        k = key() if callable(key) else int(key)
        st = SRStream(torch.tensor([k, 0], dtype=torch.int64, device=weight.device))
        _REGISTRY[weight] = st
    elif st.stream.device != weight.device:  # model.to(device) moved the weight in place
        st.stream.data = st.stream.data.to(weight.device)
    return st
