"""Rotary-embedding frequencies shared by the GPU kernels that rotate queries and keys.

Owns two halves of one computation, kept together so that ``rope`` and ``rope_kv_cache_write`` rotate
exactly alike and as the reference does (``helios_core/backends/reference_kernels.py``):

* :func:`frequency_args` validates a node's ``theta`` and optional ``frequency_band_scaling``
  (factor, low and high frequency factors, original maximum position, rounded to an integer as the
  reference does) and returns them as launch parameters: float64 values passed as their int64 bit
  patterns, so the kernel computes in float64 whatever the parameter types Triton offers;
* :func:`inverse_frequencies`, a ``triton.jit`` helper, turns those parameters into each rotated
  pair's inverse frequency in float64, band scaling included.
"""

from __future__ import annotations

import math
import struct

import triton
import triton.language as tl

from helios_core.wire import manifest_pb2 as mf
from ignition.kernels.lowering import KernelArg, LoweringContext


def float_bits(value: float) -> int:
    """The int64 bit pattern of ``value`` as a float64."""
    bits: int = struct.unpack("<q", struct.pack("<d", float(value)))[0]
    return bits


def _bits(ctx: LoweringContext, value: float) -> KernelArg:
    return ctx.i64(float_bits(value))


def frequency_args(ctx: LoweringContext, node: mf.Node) -> tuple[dict[str, KernelArg], bool]:
    """(the five ``*_bits`` launch parameters of :func:`inverse_frequencies`, whether band scaling applies).

    Raises:
        the context's lowering error: ``theta`` is not a positive number, or the band scaling is not
        four values with factor and original maximum position > 0 and high > low > 0.
    """
    theta = ctx.attribute(node, "theta")
    if not isinstance(theta, int | float) or not float(theta) > 0.0:
        raise ctx.fail(f"attribute 'theta' must be a number > 0, got {theta!r}")
    band = ctx.attribute(node, "frequency_band_scaling")
    scaling = (0.0, 0.0, 0.0, 0.0)
    if band is not None:
        if not isinstance(band, tuple | list) or len(band) != 4:
            raise ctx.fail(f"attribute 'frequency_band_scaling' needs 4 values, got {band!r}")
        factor, low, high, original = float(band[0]), float(band[1]), float(band[2]), float(round(band[3]))
        if not (factor > 0.0 and original > 0.0 and high > low > 0.0):
            raise ctx.fail(f"frequency_band_scaling needs factor, original_max_position > 0 and high > low > 0: {band}")
        scaling = (factor, low, high, original)
    names = ("factor_bits", "low_bits", "high_bits", "original_bits")
    args = {"log2_theta_bits": _bits(ctx, math.log2(float(theta)))}
    args.update({name: _bits(ctx, value) for name, value in zip(names, scaling, strict=True)})
    return args, band is not None


@triton.jit  # type: ignore[misc, untyped-decorator]
def inverse_frequencies(  # type: ignore[no-untyped-def]
    pairs,
    ROTARY_DIM: tl.constexpr,
    log2_theta_bits,
    factor_bits,
    low_bits,
    high_bits,
    original_bits,
    SCALED: tl.constexpr,
):
    """float64 ``1 / theta ** (2 * pairs / ROTARY_DIM)``, band-scaled when ``SCALED``."""
    exponent = (2 * pairs).to(tl.float64) / ROTARY_DIM
    inv_freq = 1.0 / tl.exp2(exponent * log2_theta_bits.to(tl.float64, bitcast=True))
    if SCALED:
        factor = factor_bits.to(tl.float64, bitcast=True)
        low = low_bits.to(tl.float64, bitcast=True)
        high = high_bits.to(tl.float64, bitcast=True)
        original = original_bits.to(tl.float64, bitcast=True)
        two_pi = tl.full([], 4618760256179416344, tl.int64).to(tl.float64, bitcast=True)  # 2 * pi
        wavelen = two_pi / inv_freq
        smooth = (original / wavelen - low) / (high - low)
        medium = (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = tl.where(
            wavelen < original / high, inv_freq, tl.where(wavelen > original / low, inv_freq / factor, medium)
        )
    return inv_freq
