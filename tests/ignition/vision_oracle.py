"""An independent numpy forward pass of the tiny ``vision-synthetic`` model, and images cut by hand.

Shared by the recipe tests (programs run directly) and the HTTP tests (the served model): the weights are
read back through the container API, patches are cut here without the image plugins, and the forward
pass (vision tower, merge, projector, feature rows in place of the feature tokens' embeddings, then the
Llama decoder with rotate-half rope) is written here, not taken from the reference backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from ignition.recipes.llama import tensor_names
from ignition.recipes.synthetic import SHAPES

from helios_core.loading import VerifiedCore
from helios_core.wire import container_pb2 as cb
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

F32 = npt.NDArray[np.float32]
SHAPE = SHAPES["tiny"]

IMAGE, START, END, FEATURE = 259, 260, 261, 262
"""The image sentinel, the span delimiters and the feature token of the synthetic tokenizer."""


# -- images, cut by hand ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ImageInput:
    """One image's layout tensors (one row a patch) and its feature count."""

    tensors: Mapping[str, npt.NDArray[np.generic]]
    features: int


def _normalised(pixels: npt.NDArray[np.uint8], settings: ct.ImageSettings) -> F32:
    """``(pixel / 255 - mean[c]) / std[c]`` as ``[3, height, width]``."""
    mean = np.asarray(settings.mean, dtype=np.float32)[:, None, None]
    std = np.asarray(settings.std, dtype=np.float32)[:, None, None]
    channels = pixels.transpose(2, 0, 1).astype(np.float32) / np.float32(255.0)
    normalised: F32 = ((channels - mean) / std).astype(np.float32)
    return normalised


def cut_patches(pixels: npt.NDArray[np.uint8], vision: ct.VisionContract) -> ImageInput:
    """The patches of an image whose sides already fit the preparation (no resizing): raster order with
    one patch a feature, else merge-block order (each merge_edge x merge_edge block of patches in raster
    order, the blocks in raster order); a patch row is ``patch[c, y, x]`` flattened."""
    size = vision.settings.patch_size
    merge = int(np.sqrt(vision.patches_per_feature))
    image = _normalised(pixels, vision.settings)
    grid_rows, grid_cols = image.shape[1] // size, image.shape[2] // size
    order = [
        (block_row * merge + dr, block_col * merge + dc)
        for block_row in range(grid_rows // merge)
        for block_col in range(grid_cols // merge)
        for dr in range(merge)
        for dc in range(merge)
    ]
    patches = np.stack([image[:, r * size : (r + 1) * size, c * size : (c + 1) * size].reshape(-1) for r, c in order])
    rows = np.array([r for r, _ in order], dtype=np.int32)
    cols = np.array([c for _, c in order], dtype=np.int32)
    return ImageInput({"patches": patches, "patch_rows": rows, "patch_cols": cols}, len(order) // (merge * merge))


def random_pixels(seed: int, height: int, width: int) -> npt.NDArray[np.uint8]:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


# -- weights, read back through the container API --------------------------------------------------------
def core_weights(verified: VerifiedCore) -> dict[str, F32]:
    """Every float32 weights buffer of the core, by name."""
    blobs: dict[str, bytearray] = {}
    weights: dict[str, F32] = {}
    for decl in verified.contract.execution.buffers:
        if decl.role != mf.BUFFER_ROLE_WEIGHTS or decl.dtype != mf.DTYPE_F32:
            continue
        if decl.resource_id not in blobs:
            blobs[decl.resource_id] = verified.core.read_resource(decl.resource_id, cb.RESOURCE_KIND_WEIGHTS)
        shape = [int(d.size) for d in decl.shape]
        count = int(np.prod(shape))
        weights[decl.name] = np.frombuffer(
            blobs[decl.resource_id], dtype=np.float32, count=count, offset=int(decl.resource_offset)
        ).reshape(shape)
    return weights


# -- the independent forward pass ------------------------------------------------------------------------
def _rms(x: F32, gain: F32, eps: float = 1e-5) -> F32:
    normed: F32 = (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * gain).astype(np.float32)
    return normed


def _silu(x: F32) -> F32:
    out: F32 = (x / (np.float32(1.0) + np.exp(-x))).astype(np.float32)
    return out


def oracle_features(weights: Mapping[str, F32], image: ImageInput, patches_per_feature: int) -> F32:
    """The vision tower, the merge of ``patches_per_feature`` consecutive patch rows and the projector."""
    t = image.tensors
    x = t["patches"] @ weights["v.patch_embd.weight"].T
    x = x + weights["v.pos_row.weight"][t["patch_rows"]] + weights["v.pos_col.weight"][t["patch_cols"]]
    v = _rms(x, weights["v.blk.ffn_norm.weight"])
    x = x + (_silu(v @ weights["v.blk.ffn_gate.weight"].T) * (v @ weights["v.blk.ffn_up.weight"].T)) @ (
        weights["v.blk.ffn_down.weight"].T
    )
    merged = x.reshape(x.shape[0] // patches_per_feature, -1)
    features: F32 = (_rms(merged, weights["v.proj_norm.weight"]) @ weights["v.proj.weight"].T).astype(np.float32)
    return features


def _rotate_half(x: F32, positions: npt.NDArray[np.int64]) -> F32:
    half = x.shape[-1] // 2
    inverse = 1.0 / np.power(SHAPE.rope_theta, np.arange(0, 2 * half, 2, dtype=np.float64) / (2 * half))
    angles = positions[:, None].astype(np.float64) * inverse[None, :]
    cos, sin = np.cos(angles).astype(np.float32)[:, None, :], np.sin(angles).astype(np.float32)[:, None, :]
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1).astype(np.float32)


def oracle_logits(weights: Mapping[str, F32], rows: F32) -> F32:
    """The Llama decoder over input rows ``[T, hidden]``: the last token's logits."""
    s = SHAPE
    count = rows.shape[0]
    positions = np.arange(count, dtype=np.int64)
    causal = np.tril(np.ones((count, count), dtype=bool))
    x = rows
    for layer in range(s.layers):
        names = tensor_names(layer)
        h = _rms(x, weights[names["attn_norm"]])
        q = _rotate_half((h @ weights[names["wq"]].T).reshape(count, s.heads, s.head_dim), positions)
        k = _rotate_half((h @ weights[names["wk"]].T).reshape(count, s.kv_heads, s.head_dim), positions)
        v = (h @ weights[names["wv"]].T).reshape(count, s.kv_heads, s.head_dim)
        group = s.heads // s.kv_heads
        keys, values = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [T, heads, hd]
        scores = np.einsum("thd,shd->hts", q, keys) * np.float32(s.head_dim**-0.5)
        scores = np.where(causal[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        attended = np.einsum("hts,shd->thd", probs, values).astype(np.float32)
        x = x + attended.reshape(count, -1) @ weights[names["wo"]].T
        h = _rms(x, weights[names["ffn_norm"]])
        x = x + (_silu(h @ weights[names["w_gate"]].T) * (h @ weights[names["w_up"]].T)) @ weights[names["w_down"]].T
    logits: F32 = (_rms(x[-1:], weights["output_norm.weight"]) @ weights["output.weight"].T)[0].astype(np.float32)
    return logits


def oracle_greedy(
    verified: VerifiedCore, prompt: Sequence[int], images: Sequence[tuple[int, ImageInput]], count: int
) -> list[int]:
    """Greedy tokens of the model: each image's features replace the input rows of its feature tokens
    (``images``: the prompt index of the image's first feature token, and the image)."""
    weights = core_weights(verified)
    vision = verified.contract.model.vision
    table = weights["tok_embd"]
    sampled = verified.contract.sampled_size
    features = {
        first: oracle_features(weights, image, vision.patches_per_feature) for first, image in images
    }  # fmt: skip
    tokens, generated = list(prompt), []
    for _ in range(count):
        rows = table[tokens].copy()
        for first, rows_of_image in features.items():
            rows[first : first + rows_of_image.shape[0]] = rows_of_image
        generated.append(int(np.argmax(oracle_logits(weights, rows)[:sampled])))
        tokens.append(generated[-1])
    return generated


def placed(prompt: Sequence[int], images: Sequence[ImageInput]) -> tuple[list[int], list[tuple[int, ImageInput]]]:
    """``prompt`` with each image sentinel replaced by its span (start, one feature token a feature, end);
    returns the ids and each image's first feature token index."""
    ids: list[int] = []
    firsts: list[tuple[int, ImageInput]] = []
    remaining = list(images)
    for token in prompt:
        if token != IMAGE:
            ids.append(token)
            continue
        image = remaining.pop(0)
        ids.append(START)
        firsts.append((len(ids), image))
        ids.extend([FEATURE] * image.features)
        ids.append(END)
    assert not remaining
    return ids, firsts
