"""Sampling settings: their one declaration, a request's values, what a core's inputs hold, fresh seeds.

Owns :class:`SamplingParams` (the complete per-request settings that cross to the model worker),
the declaration of every sampling parameter on its fields (:class:`SamplingField` metadata, read into
:data:`SAMPLING_PARAMETERS`: the value source that packs it, its kind, neutral value, meaningful range,
per-slot column type and sample-kernel input; packing, the scheduler's columns, the reference sampler,
the op catalogue, bootstrap's ranges, server preparation and Ignition's bindings all derive from it),
:class:`SamplingLimits` (from the transport dtypes and offsets a core binds its sampling sources to,
which values of each setting pack as themselves: a float that stays finite, and normal where zero
means nothing; an integer within its type) and :func:`fresh_seed` (the seed of a request that names
none, drawn from the operating system's random source within what the core's seed input holds).

This module sits below the frontend and the runtime: both import it, and it imports nothing of
Helios but the wire schema and the dtype table, so the frontend never reaches up into the runtime.
Preparation and admission check requests against :class:`SamplingLimits`, so packing never meets a
value that would fail a shared round.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol, cast, get_type_hints

import msgspec
import numpy as np

from helios_core.dtypes import NUMPY_DTYPES, dtype_name
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

SamplingKind = Literal["float", "int", "seed"]
"""How a sampling parameter's values are typed: a real number, a signed integer, or the request seed."""

_COLUMN_DTYPES: Mapping[str, np.dtype[Any]] = {
    "float": np.dtype(np.float64),
    "int": np.dtype(np.int64),
    "seed": np.dtype(np.uint64),
}
"""The numpy type a per-slot column of each kind holds its values in exactly."""

_EXACT_FLOAT_INT = 2**53
"""The largest magnitude below which every integer is a float64 exactly."""

_INF = float("inf")

SEED_RANGE = (0, 2**64 - 1)
"""The seeds a request may name before a core narrows them (the widest packed seed is unsigned 64-bit)."""


@dataclass(frozen=True)
class SamplingField:
    """What one :class:`SamplingParams` field declares about itself (its ``Annotated`` metadata).

    The field's name and default complete it into a :class:`SamplingParameter`; msgspec ignores this
    metadata, so encoding and decoding see the plain field type.
    """

    source: int
    """The contract value source that packs the parameter (``ct.VALUE_SOURCE_...``)."""
    kind: SamplingKind
    meaningful: tuple[float, float, bool]
    """(least, greatest, whether the least is excluded) of the values that mean something."""
    nonzero: bool = False
    """Zero means nothing: a value packing as zero or a subnormal number does not fit."""
    kernel_input: str | None = None
    """The op catalogue ``sample`` input that receives it; None: the field's name."""

    def __post_init__(self) -> None:
        if self.kind not in _COLUMN_DTYPES:
            raise ValueError(f"unknown sampling kind {self.kind!r}; known: {', '.join(_COLUMN_DTYPES)}")


@dataclass(frozen=True)
class SamplingParameter:
    """One sampling parameter, as every table that handles sampling values derives it."""

    name: str
    """The :class:`SamplingParams` field (and the request, contract-default and transport name)."""
    source: int
    """The contract value source that packs it."""
    kind: SamplingKind
    default: float
    """The neutral value: what a request that names nothing and a core that recommends nothing get."""
    meaningful: tuple[float, float, bool]
    """(least, greatest, whether the least is excluded): the values a request may name before a core
    narrows them to what its inputs hold."""
    nonzero: bool
    """Zero means nothing (see :data:`NONZERO_FIELDS`)."""
    column_dtype: np.dtype[Any]
    """The numpy type a per-slot column holds it in exactly: float64, int64 (``int``), uint64 (``seed``)."""
    kernel_input: str
    """The op catalogue ``sample`` input that receives it."""

    def column_holds(self, value: object) -> bool:
        """Whether a column of :attr:`column_dtype` holds ``value`` exactly as the Python value packs: a
        float parameter a float, or an integer (or bool) of magnitude at most 2^53; an integer parameter
        an ``int`` within the column type's range."""
        kind = type(value)
        if self.kind == "float":
            return kind is float or (kind in (int, bool) and isinstance(value, int) and abs(value) <= _EXACT_FLOAT_INT)
        if kind is not int or not isinstance(value, int):
            return False
        low, high = integer_range(self.column_dtype)
        return low <= value <= high


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """Complete per-request sampling settings (request values over core defaults).

    Each field declares its sampling parameter (:class:`SamplingField`); adding a field here adds the
    parameter everywhere it is handled (``docs/runtime-design.md``, *Sampling parameters*).
    """

    temperature: Annotated[
        float, SamplingField(source=ct.VALUE_SOURCE_TEMPERATURE, kind="float", meaningful=(0, _INF, False))
    ] = 1.0
    top_p: Annotated[
        float, SamplingField(source=ct.VALUE_SOURCE_TOP_P, kind="float", meaningful=(0, 1, True), nonzero=True)
    ] = 1.0
    top_k: Annotated[int, SamplingField(source=ct.VALUE_SOURCE_TOP_K, kind="int", meaningful=(0, _INF, False))] = 0
    min_p: Annotated[float, SamplingField(source=ct.VALUE_SOURCE_MIN_P, kind="float", meaningful=(0, 1, False))] = 0.0
    repetition_penalty: Annotated[
        float,
        SamplingField(
            source=ct.VALUE_SOURCE_REPETITION_PENALTY, kind="float", meaningful=(0, _INF, True), nonzero=True
        ),
    ] = 1.0
    frequency_penalty: Annotated[
        float, SamplingField(source=ct.VALUE_SOURCE_FREQUENCY_PENALTY, kind="float", meaningful=(-2, 2, False))
    ] = 0.0
    presence_penalty: Annotated[
        float, SamplingField(source=ct.VALUE_SOURCE_PRESENCE_PENALTY, kind="float", meaningful=(-2, 2, False))
    ] = 0.0
    seed: Annotated[
        int, SamplingField(source=ct.VALUE_SOURCE_SEED_BITS, kind="seed", meaningful=(*SEED_RANGE, False))
    ] = 0


class BoundGraph(Protocol):
    """A graph as :meth:`SamplingLimits.of` reads it: its contract's value bindings."""

    @property
    def contract(self) -> ct.GraphContract: ...


class BoundContract(Protocol):
    """A prepared contract as :meth:`SamplingLimits.of` reads it: graphs and transport entries."""

    @property
    def graphs(self) -> Mapping[str, BoundGraph]: ...

    @property
    def transport(self) -> Mapping[str, mf.TransportEntry]: ...


@functools.cache
def integer_range(dtype: np.dtype[np.generic]) -> tuple[int, int]:
    """The smallest and largest value of an integer dtype (``np.iinfo`` takes microseconds a call)."""
    info = np.iinfo(cast("np.dtype[np.integer[Any]]", dtype))
    return int(info.min), int(info.max)


def declared_parameters(settings: type[msgspec.Struct]) -> tuple[SamplingParameter, ...]:
    """The sampling parameters ``settings`` declares, in field order: each field's :class:`SamplingField`
    completed by its name and default.

    Raises:
        TypeError: a field carries no declaration, or more than one.
        ValueError: two fields name the same value source.
    """
    hints = get_type_hints(settings, include_extras=True)
    neutral = settings()
    found: list[SamplingParameter] = []
    for name in settings.__struct_fields__:
        declared = [item for item in getattr(hints[name], "__metadata__", ()) if isinstance(item, SamplingField)]
        if len(declared) != 1:
            raise TypeError(f"{settings.__name__}.{name} must carry exactly one SamplingField, not {len(declared)}")
        field_declaration = declared[0]
        found.append(
            SamplingParameter(
                name=name,
                source=field_declaration.source,
                kind=field_declaration.kind,
                default=getattr(neutral, name),
                meaningful=field_declaration.meaningful,
                nonzero=field_declaration.nonzero,
                column_dtype=_COLUMN_DTYPES[field_declaration.kind],
                kernel_input=field_declaration.kernel_input or name,
            )
        )
    sources = [parameter.source for parameter in found]
    if len(set(sources)) != len(sources):
        raise ValueError(f"{settings.__name__} names a value source twice: {sources}")
    return tuple(found)


SAMPLING_PARAMETERS: tuple[SamplingParameter, ...] = declared_parameters(SamplingParams)
"""Every sampling parameter, in :class:`SamplingParams` field order: the one declaration the packing row
sources, the scheduler's per-slot columns, the reference sampler, the op catalogue's ``sample`` inputs,
bootstrap's ranges, server preparation and Ignition's bindings derive from."""

SAMPLING_FIELDS: Mapping[int, str] = {parameter.source: parameter.name for parameter in SAMPLING_PARAMETERS}
"""The request's sampling settings (``SamplingParams`` fields) by the value source that packs each."""

NONZERO_FIELDS = frozenset(parameter.name for parameter in SAMPLING_PARAMETERS if parameter.nonzero)
"""Sampling settings for which zero means nothing: a value that packs as zero or as a subnormal number
(which a device may flush to zero) does not fit."""

_BF16_MAX = 3.3895313892515355e38
"""The largest finite bfloat16 (float32's exponent range, 8 significant bits)."""


@dataclass(frozen=True)
class PackedInput:
    """One destination a sampling setting packs into: the type it is staged as, and the binding's offset.

    ``high`` is the largest magnitude the staged type holds (a float packs when it rounds to at most
    that), ``smallest`` its smallest normal magnitude (0 for integers), ``low`` its least integer.
    """

    kind: str
    """The destination's wire type (``f32``, ``i32``...), for messages."""
    cast: np.dtype[Any] | None
    """The numpy type a float is rounded to when staged; None for an integer destination."""
    low: float
    high: float
    smallest: float
    offset: int

    def fits(self, value: float, *, nonzero: bool) -> bool:
        """Whether ``value`` packs here as itself: an integer within range, or a float that stays finite
        and, when zero means nothing, neither zero nor subnormal."""
        if self.cast is None:
            if type(value) is not int and (not isinstance(value, int | np.integer) or isinstance(value, bool)):
                return False  # a float is not an integer input's value, even when whole
            return bool(self.low <= int(value) + self.offset <= self.high)
        try:
            packed = float(value) + self.offset
        except (OverflowError, TypeError, ValueError):
            return False
        magnitude = abs(packed)
        if magnitude <= self.high and (not nonzero or magnitude >= self.smallest):
            return True  # within the type's range it rounds to a finite value, and at least its smallest normal
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):  # at the edges: round as staging does
            staged = abs(float(self.cast.type(packed)))
        if not staged <= self.high:  # also false for NaN and infinity
            return False
        return not nonzero or staged >= self.smallest


@dataclass(frozen=True)
class SamplingLimits:
    """Where each sampling setting is packed, for checking requests before any round packs them.

    Derived from the transport dtypes and offsets of every binding of a sampling value source, over all
    of the contract's graphs (a setting no program binds has no entry). A value that does not pack as
    itself (a float overflowing to infinity or rounding to zero, an integer outside its type) would fail
    the round that packs it, so requests are checked once at preparation and again at admission.
    """

    inputs: Mapping[str, tuple[PackedInput, ...]] = field(default_factory=dict)
    _checks: tuple[tuple[str, bool, tuple[PackedInput, ...]], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        checks = tuple((name, name in NONZERO_FIELDS, inputs) for name, inputs in self.inputs.items())
        object.__setattr__(self, "_checks", checks)

    @classmethod
    def of(cls, contract: BoundContract) -> SamplingLimits:
        found: dict[str, dict[tuple[str, int], PackedInput]] = {}
        for graph in contract.graphs.values():
            for binding in graph.contract.bindings:
                name = SAMPLING_FIELDS.get(binding.source)
                entry = contract.transport.get(binding.destination)
                if name is None or entry is None:
                    continue
                packed = packed_input(entry.dtype, binding.offset)
                if packed is not None:
                    found.setdefault(name, {})[(packed.kind, packed.offset)] = packed
        return cls({name: tuple(inputs.values()) for name, inputs in found.items()})

    def bounds(self, name: str) -> tuple[float, float, str] | None:
        """(least, greatest, the narrowest destination's type) of the values ``name`` packs as; the least is
        the smallest normal magnitude for a setting of :data:`NONZERO_FIELDS`. None when nothing packs it.
        Both bounds are written to float32 precision where they are not integers, and pack as written."""
        inputs = self.inputs.get(name)
        if not inputs:
            return None
        narrowest = min(inputs, key=lambda packed: packed.high)
        high = min(packed.high - packed.offset for packed in inputs)
        if name in NONZERO_FIELDS:
            low = max(packed.smallest for packed in inputs)
        else:
            low = max((packed.low if packed.cast is None else -packed.high) - packed.offset for packed in inputs)
        return low, high, narrowest.kind

    def fits(self, name: str, value: float) -> bool:
        """Whether ``value`` of setting ``name`` packs into every destination the core binds it to."""
        nonzero = name in NONZERO_FIELDS
        return all(packed.fits(value, nonzero=nonzero) for packed in self.inputs.get(name, ()))

    def problem(self, params: SamplingParams) -> tuple[str, str] | None:
        """(field, message) of the first setting of ``params`` that does not pack; None when all do."""
        for name, nonzero, inputs in self._checks:
            value = getattr(params, name)
            for packed in inputs:
                if not packed.fits(value, nonzero=nonzero):
                    bounds = self.bounds(name)
                    low, high, kind = bounds if bounds is not None else (0.0, 0.0, "")
                    return name, (
                        f"{name}={value!r} does not fit the core's {kind} sampling input: it must lie in "
                        f"[{format_bound(low)}, {format_bound(high)}]"
                    )
        return None


def packed_input(dtype: int, offset: int) -> PackedInput | None:
    """How a value reaches a destination of wire ``dtype`` that adds ``offset``; None for an unknown type."""
    kind = dtype_name(dtype)
    if dtype == mf.DTYPE_BF16:  # staged from float32 values
        single = np.dtype(np.float32)
        return PackedInput(kind, single, -_BF16_MAX, _BF16_MAX, float(np.finfo(single).tiny), offset)
    numpy_dtype = NUMPY_DTYPES.get(dtype)
    if numpy_dtype is None:
        return None
    if numpy_dtype.kind == "f":
        info = np.finfo(cast("np.dtype[np.floating[Any]]", numpy_dtype))
        return PackedInput(kind, numpy_dtype, -float(info.max), float(info.max), float(info.tiny), offset)
    low, high = integer_range(numpy_dtype)
    return PackedInput(kind, None, low, high, 0.0, offset)


def format_bound(value: float) -> str:
    """A range bound for a message: an integer as it is, a float to float32 precision (written so, the
    bound of a float type still rounds to a finite, normal value of that type)."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return f"{value:.8g}"


def _seed_range(limits: SamplingLimits | None) -> tuple[int, int]:
    """The seeds every seed input of a core with ``limits`` holds (all of [0, 2^64) without limits)."""
    low, high = SEED_RANGE
    bounds = limits.bounds("seed") if limits is not None else None
    if bounds is not None:
        low, high = max(low, int(bounds[0])), min(high, int(bounds[1]))
    return low, high


def fresh_seed(limits: SamplingLimits | None = None) -> int:
    """A seed for a request that names none: uniform over the seeds every seed input of a core with
    ``limits`` holds (all of [0, 2^64) without limits), from the operating system's random source, so
    unseeded requests with the same prompt and settings draw independent samples."""
    low, high = _seed_range(limits)
    if high < low:  # a core whose seed input holds no seed at all: its own validation refuses any value
        return low
    return low + secrets.randbelow(high - low + 1)


def choice_seed(seed: int, index: int, limits: SamplingLimits | None = None) -> int:
    """The seed of choice ``index`` of a request seeded ``seed`` (``n`` > 1): ``seed + index``, wrapped
    within the seeds the core's inputs hold, so each choice draws its own samples and the same request
    gives the same choices again (choice 0 is the request's own seed)."""
    low, high = _seed_range(limits)
    if high < low:
        return seed
    return low + (seed - low + index) % (high - low + 1)
