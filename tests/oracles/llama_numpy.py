"""Plain float32 numpy forward pass of a Llama-family model (test oracle).

Independent of all Helios/Ignition code on purpose: it only needs numpy, a
mapping of already-dequantized float32 tensors named as in GGUF files
(``token_embd.weight``, ``blk.{i}.attn_q.weight``, ...; row-major, so a linear
weight is ``[n_out, n_in]``) and the hyperparameters (which
:meth:`LlamaHParams.from_gguf_metadata` reads from plain GGUF metadata
key/values).

The math, kept straightforward rather than fast:

* ``x = token_embd[ids]``; per layer
  ``x += Wo @ attn(rope(Wq @ rms(x)), rope(Wk @ rms(x)), Wv @ rms(x))`` and
  ``x += Wdown @ (silu(Wgate @ rms(x)) * (Wup @ rms(x)))``;
  logits ``= output @ rms(x)`` (``output.weight`` falls back to
  ``token_embd.weight`` when absent: tied embeddings).
* RMSNorm: ``x / sqrt(mean(x**2) + eps) * w``.
* Causal softmax attention, scale ``1/sqrt(head_dim)``, grouped-query: query
  head ``h`` reads KV head ``h // (n_head // n_head_kv)``.
* RoPE, llama.cpp rope type "normal": llama.cpp's GGUF converter permutes the
  rows of Q and K so that each head's *adjacent* pairs ``(x[2i], x[2i+1])``
  rotate together by ``pos * base**(-2i/n_rot)``. The weights are used as
  stored in the GGUF, so the rotation is applied to adjacent pairs here (not
  the "rotate half" form of HF checkpoints). Angles are computed in float64
  and their cos/sin rounded to float32; everything else is float32.

A simple contiguous KV cache (preallocated per call) avoids recomputing the
prefix during :meth:`LlamaNumpy.greedy`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

F32 = np.float32
Array = NDArray[np.float32]


@dataclass(frozen=True)
class LlamaHParams:
    n_layer: int
    n_head: int
    n_head_kv: int
    n_embd: int
    rms_eps: float
    rope_freq_base: float
    context_length: int
    #: rotated dims per head (GGUF ``rope.dimension_count``; defaults to head_dim)
    n_rot: int

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, object]) -> LlamaHParams:
        """Read ``{arch}.*`` hyperparameters from GGUF metadata key/values."""
        arch = meta["general.architecture"]

        def get(key: str, default: object = None) -> object:
            full = f"{arch}.{key}"
            if full in meta:
                return meta[full]
            if default is None:
                raise KeyError(f"GGUF metadata lacks {full!r}")
            return default

        def as_int(v: object) -> int:
            if not isinstance(v, int):
                raise TypeError(f"expected int, got {v!r}")
            return v

        def as_float(v: object) -> float:
            if not isinstance(v, int | float):
                raise TypeError(f"expected number, got {v!r}")
            return float(v)

        n_embd = as_int(get("embedding_length"))
        n_head = as_int(get("attention.head_count"))
        return cls(
            n_layer=as_int(get("block_count")),
            n_head=n_head,
            n_head_kv=as_int(get("attention.head_count_kv", n_head)),
            n_embd=n_embd,
            rms_eps=as_float(get("attention.layer_norm_rms_epsilon")),
            rope_freq_base=as_float(get("rope.freq_base", 10000.0)),
            context_length=as_int(get("context_length")),
            n_rot=as_int(get("rope.dimension_count", n_embd // n_head)),
        )


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    ms = np.mean(x * x, axis=-1, keepdims=True, dtype=F32)
    return ((x / np.sqrt(ms + F32(eps))) * weight).astype(F32, copy=False)


def silu(x: Array) -> Array:
    # sigmoid(x) = 0.5 * (1 + tanh(x / 2)) -- no overflow for large |x|
    sigmoid: Array = F32(0.5) * (F32(1.0) + np.tanh(x * F32(0.5)))
    return (x * sigmoid).astype(F32, copy=False)


def rope_adjacent_pairs(x: Array, positions: NDArray[np.int64], n_rot: int, base: float) -> Array:
    """Rotate adjacent pairs of the first ``n_rot`` dims. x: [n_heads, n_tok, head_dim]."""
    i = np.arange(n_rot // 2, dtype=np.float64)
    inv_freq = base ** (-2.0 * i / n_rot)
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [n_tok, n_rot/2]
    cos = np.cos(angles).astype(F32)
    sin = np.sin(angles).astype(F32)
    out = x.copy()
    x0 = x[..., 0:n_rot:2]
    x1 = x[..., 1:n_rot:2]
    out[..., 0:n_rot:2] = x0 * cos - x1 * sin
    out[..., 1:n_rot:2] = x0 * sin + x1 * cos
    return out


def softmax(x: Array) -> Array:
    e: Array = np.exp(x - np.max(x, axis=-1, keepdims=True))
    total: Array = np.sum(e, axis=-1, keepdims=True)
    return (e / total).astype(F32, copy=False)


class LlamaNumpy:
    """Reference Llama forward pass over float32 GGUF-named tensors."""

    def __init__(self, tensors: Mapping[str, NDArray[np.float32]], hparams: LlamaHParams) -> None:
        self.hp = hparams
        hp = hparams
        if hp.n_embd % hp.n_head or hp.n_head % hp.n_head_kv or hp.n_rot % 2 or hp.n_rot > hp.head_dim:
            raise ValueError(f"inconsistent hyperparameters: {hp}")

        def get(name: str, shape: tuple[int, ...]) -> Array:
            t = np.asarray(tensors[name], dtype=F32)
            if t.shape != shape:
                raise ValueError(f"{name}: shape {t.shape}, expected {shape}")
            return t

        d, hd = hp.n_embd, hp.head_dim
        self.tok_embd = np.asarray(tensors["token_embd.weight"], dtype=F32)
        if self.tok_embd.ndim != 2 or self.tok_embd.shape[1] != d:
            raise ValueError(f"token_embd.weight: shape {self.tok_embd.shape}")
        n_vocab = self.tok_embd.shape[0]
        self.output = get("output.weight", (n_vocab, d)) if "output.weight" in tensors else self.tok_embd
        self.output_norm = get("output_norm.weight", (d,))
        self.layers: list[dict[str, Array]] = []
        for i in range(hp.n_layer):
            p = f"blk.{i}."
            n_ff = np.asarray(tensors[p + "ffn_gate.weight"]).shape[0]
            self.layers.append(
                {
                    "attn_norm": get(p + "attn_norm.weight", (d,)),
                    "wq": get(p + "attn_q.weight", (hp.n_head * hd, d)),
                    "wk": get(p + "attn_k.weight", (hp.n_head_kv * hd, d)),
                    "wv": get(p + "attn_v.weight", (hp.n_head_kv * hd, d)),
                    "wo": get(p + "attn_output.weight", (d, hp.n_head * hd)),
                    "ffn_norm": get(p + "ffn_norm.weight", (d,)),
                    "w_gate": get(p + "ffn_gate.weight", (n_ff, d)),
                    "w_up": get(p + "ffn_up.weight", (n_ff, d)),
                    "w_down": get(p + "ffn_down.weight", (d, n_ff)),
                }
            )
        self._k: list[Array] = []
        self._v: list[Array] = []
        self._n_past = 0

    def reset(self, capacity: int) -> None:
        """Empty the KV cache and size it for ``capacity`` positions."""
        hp = self.hp
        if capacity > hp.context_length:
            raise ValueError(f"{capacity} positions exceed the context length {hp.context_length}")
        shape = (hp.n_head_kv, capacity, hp.head_dim)
        self._k = [np.zeros(shape, dtype=F32) for _ in range(hp.n_layer)]
        self._v = [np.zeros(shape, dtype=F32) for _ in range(hp.n_layer)]
        self._n_past = 0

    def forward(self, token_ids: Sequence[int]) -> Array:
        """Append ``token_ids`` to the sequence; return their logits [n_tok, n_vocab]."""
        hp = self.hp
        n_tok = len(token_ids)
        start = self._n_past
        end = start + n_tok
        if not self._k or end > self._k[0].shape[1]:
            raise ValueError("KV cache too small: call reset(capacity) first")
        hd, group = hp.head_dim, hp.n_head // hp.n_head_kv
        positions = np.arange(start, end, dtype=np.int64)
        # causal mask over the cached prefix + the new tokens
        mask = np.where(np.arange(end)[None, :] <= positions[:, None], F32(0.0), F32(-np.inf)).astype(F32)
        scale = F32(1.0 / np.sqrt(hd))

        x = self.tok_embd[np.asarray(token_ids, dtype=np.int64)]
        for li, w in enumerate(self.layers):
            h = rms_norm(x, w["attn_norm"], hp.rms_eps)
            q = (h @ w["wq"].T).reshape(n_tok, hp.n_head, hd).transpose(1, 0, 2)
            k = (h @ w["wk"].T).reshape(n_tok, hp.n_head_kv, hd).transpose(1, 0, 2)
            v = (h @ w["wv"].T).reshape(n_tok, hp.n_head_kv, hd).transpose(1, 0, 2)
            q = rope_adjacent_pairs(q, positions, hp.n_rot, hp.rope_freq_base)
            k = rope_adjacent_pairs(k, positions, hp.n_rot, hp.rope_freq_base)
            self._k[li][:, start:end] = k
            self._v[li][:, start:end] = v
            keys = self._k[li][:, :end]
            values = self._v[li][:, :end]
            attn = np.empty((hp.n_head, n_tok, hd), dtype=F32)
            for hh in range(hp.n_head):
                kv = hh // group
                scores = (q[hh] @ keys[kv].T) * scale + mask
                attn[hh] = softmax(scores) @ values[kv]
            x = (x + attn.transpose(1, 0, 2).reshape(n_tok, hp.n_head * hd) @ w["wo"].T).astype(F32, copy=False)

            h = rms_norm(x, w["ffn_norm"], hp.rms_eps)
            ff = silu(h @ w["w_gate"].T) * (h @ w["w_up"].T)
            x = (x + ff @ w["w_down"].T).astype(F32, copy=False)

        self._n_past = end
        h = rms_norm(x, self.output_norm, hp.rms_eps)
        logits: Array = h @ self.output.T
        return logits

    def greedy(self, token_ids: Sequence[int], n_new: int) -> list[int]:
        """Greedy-decode ``n_new`` tokens after ``token_ids`` (never stops at EOS)."""
        if not token_ids:
            raise ValueError("greedy() needs at least one prompt token")
        self.reset(len(token_ids) + n_new)
        out: list[int] = []
        logits = self.forward(token_ids)[-1]
        for step in range(n_new):
            nxt = int(np.argmax(logits))
            out.append(nxt)
            if step + 1 < n_new:
                logits = self.forward([nxt])[-1]
        return out
