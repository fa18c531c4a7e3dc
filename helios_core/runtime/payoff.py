"""Whether speculative rounds pay for themselves, measured while serving (``--speculation-payoff``).

Owns :class:`SpeculationPayoff`, which the speculative planner asks before it plans a speculative round (and
the round planner before it launches a decode round ahead), and which the scheduler tells when a round has
completed and how many tokens it emitted. Speculation pays when it emits more tokens per
request per second than decode does: a speculative round emits one to W tokens a lane but costs more than a
decode step (the rows it verifies, and the host's planning, which no round in flight hides, since each
speculative round is planned from the previous one's completion), and decode rounds run two frames deep.
Which is faster depends on the core, the GPU, the batch and the text, so it is measured:

* A round's cost is the time from the previous round's completion (of any kind; while a decode-ready
  request waits, rounds follow one another) to its own completion. For a decode round launched ahead of
  the previous completion that is the interval between completions (a step with the host's work hidden);
  for a speculative round it is the previous round's publishing, its own planning, execution and
  completion.
* Serving alternates a probe of each kind (:data:`PROBE_ROUNDS` rounds, the first of each not counted: it
  drains or refills the frames; :data:`RECHECK_ROUNDS` for speculation after a decode stretch) with a
  stretch of the faster kind (:data:`STRETCH_ROUNDS` rounds, doubled each time the same kind wins again,
  up to :data:`STRETCH_GROWTH` times; speculation must lead by :data:`MARGIN`). A decode stretch is also
  long enough that the recheck after it, at the loss per speculative round just measured, costs at most
  :data:`PROBE_SHARE` of the stretch's time (a speculative round of a large batch can cost ten decode
  steps), up to :data:`MAX_STRETCH_ROUNDS`. A probe of speculation without a speculative round (no
  proposals) measures it at nothing. During a decode probe or stretch, decode rounds are launched ahead as
  without speculation.
* Each band of member counts (1, 2, 3 to 4, 5 to 8, ...) has its own cycle and measurements: a count of
  decode-ready requests that moves to another band resumes that band's cycle where it was, and a round
  counts towards the band of its own lanes. A new band starts with its probes, unless the nearest smaller
  band that has chosen chose decode: the new band then starts with a decode stretch as long as that band's
  last one. Speculation pays less as the batch grows (a decode round's rows stream the weights nearly for
  free at a small batch; at a large one each verified row costs compute), so a band does not probe what a
  smaller one found slower, and a membership that grows through the bands (a burst of arrivals) runs no
  speculative probe at each.

Greedy output does not depend on the choice (speculation is exact), nor does seeded sampling (each program
advances a row's random stream by its declared draws); only the speed does.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from helios_core.runtime.plan import RoundPlan
from helios_core.wire import contract_pb2 as ct

PROBE_ROUNDS = 4
"""Rounds of each kind one measurement takes (the first of them is not counted)."""

RECHECK_ROUNDS = 2
"""Rounds of the probe of speculation in a band whose last stretch was decode (the first not counted, so
one is measured; a speculative round of a large batch already averages its many lanes): that probe costs
what speculation loses, and at a large batch one speculative round can cost several decode steps."""

STRETCH_ROUNDS = 64
"""Rounds of the faster kind between two measurements, the first time it is chosen in a band."""

STRETCH_GROWTH = 16
"""A stretch doubles each time the same kind is chosen again in its band, up to this many times
:data:`STRETCH_ROUNDS`: a probe of the slower kind costs a fixed few rounds (a speculative round of a large
batch can cost several decode steps), so a settled choice is measured less and less often."""

MAX_STRETCH_ROUNDS = STRETCH_ROUNDS * STRETCH_GROWTH
"""The longest stretch: a settled choice is measured again at least this often (the text, and with it the
acceptance, changes as requests come and go)."""

PROBE_SHARE = 0.02
"""At most this share of a decode stretch's time goes to the recheck of speculation after it, at the loss per
speculative round the last probe measured (the stretch lengthens to hold it, up to :data:`MAX_STRETCH_ROUNDS`)."""

MARGIN = 1.05
"""Speculation is chosen when it measured more than this many times decode's rate: a lead of a few per cent
over a short probe is within its noise, and decode then keeps its rounds two frames deep."""


class Phase(enum.Enum):
    """Where a band is in its cycle of measurements and stretches."""

    PROBE_SPECULATION = "probe speculation"
    PROBE_DECODE = "probe decode"
    SPECULATE = "speculate"
    DECODE = "decode"

    @property
    def speculates(self) -> bool:
        return self in (Phase.PROBE_SPECULATION, Phase.SPECULATE)


def members_band(members: int) -> int:
    """The band of a member count: 0 for one, 1 for two, 2 for three and four, 3 for five to eight, ..."""
    return max(members - 1, 0).bit_length()


@dataclass
class _Tally:
    """Measured rounds of one kind: their cost and the tokens each lane emitted."""

    seconds: float = 0.0
    tokens_per_lane: float = 0.0
    rounds: int = 0

    def add(self, seconds: float, tokens_per_lane: float) -> None:
        self.seconds += seconds
        self.tokens_per_lane += tokens_per_lane
        self.rounds += 1

    def rate(self) -> float:
        """Tokens a lane emits per second (0 without a measured round)."""
        return self.tokens_per_lane / self.seconds if self.rounds and self.seconds > 0 else 0.0


@dataclass
class _Band:
    """One band's place in its cycle: the phase, its rounds left, the probe's tallies, the last choice."""

    phase: Phase = Phase.PROBE_SPECULATION
    left: int = PROBE_ROUNDS
    counted: int = 0
    """Rounds of the probe's kind seen in the current probe (the first is not measured)."""
    speculative: _Tally = field(default_factory=_Tally)
    decode: _Tally = field(default_factory=_Tally)
    chosen: Phase | None = None
    repeats: int = 0
    """How many stretches in a row chose ``chosen`` (the stretch length doubles with each)."""
    stretch: int = 0
    """The length in rounds of the last stretch begun."""

    def begin(self, phase: Phase, *, at_least: int = 0) -> None:
        """Enter ``phase``; a stretch lasts at least ``at_least`` rounds (up to :data:`MAX_STRETCH_ROUNDS`)."""
        self.phase, self.counted = phase, 0
        if phase is Phase.PROBE_SPECULATION:
            self.speculative, self.decode = _Tally(), _Tally()
        if phase in (Phase.SPECULATE, Phase.DECODE):
            self.repeats = self.repeats + 1 if phase is self.chosen else 1
            self.chosen = phase
            doubled = STRETCH_ROUNDS * min(2 ** (self.repeats - 1), STRETCH_GROWTH)
            self.left = self.stretch = min(max(doubled, at_least), MAX_STRETCH_ROUNDS)
        elif phase is Phase.PROBE_SPECULATION and self.chosen is Phase.DECODE:
            self.left = RECHECK_ROUNDS
        else:
            self.left = PROBE_ROUNDS


class SpeculationPayoff:
    """Measures speculative and decode rounds and says which kind to plan (module docstring)."""

    def __init__(self, stretches: dict[str, int], clock: Callable[[], int] = time.monotonic_ns) -> None:
        self._clock = clock
        self._bands: dict[int, _Band] = {}
        self._band = _Band()
        """The band of the decode-ready requests the planner asked about last."""
        self._completed_ns: int | None = None
        self.stretches = stretches
        """Stretches chosen so far, by kind ("speculate", "decode"): the worker's statistics count them."""
        self.rates: tuple[float, float] = (0.0, 0.0)
        """The last measurement's tokens per lane per second: speculative rounds, decode rounds."""

    @property
    def phase(self) -> Phase:
        """The phase of the band asked about last."""
        return self._band.phase

    def _of(self, members: int) -> _Band:
        """The band of ``members``; a new one starts with its probes, or with a decode stretch as long as the
        last one of the nearest smaller band that has chosen, where that band chose decode."""
        number = members_band(members)
        band = self._bands.get(number)
        if band is None:
            band = self._bands[number] = _Band()
            smaller = next(
                (self._bands[n] for n in sorted(self._bands, reverse=True) if n < number and self._bands[n].chosen),
                None,
            )
            if smaller is not None and smaller.chosen is Phase.DECODE:
                self._choose(band, Phase.DECODE, at_least=smaller.stretch)
        return band

    def _choose(self, band: _Band, phase: Phase, *, at_least: int = 0) -> None:
        """Begin a stretch of ``phase`` in ``band`` (of at least ``at_least`` rounds) and count it."""
        self.stretches[phase.value] = self.stretches.get(phase.value, 0) + 1
        band.begin(phase, at_least=at_least)

    def speculate(self, members: int) -> bool:
        """Whether a round of ``members`` decode-ready requests should be speculative (each band keeps its
        own cycle: a count that moves between bands resumes each where it was)."""
        self._band = self._of(members)
        return self._band.phase.speculates

    def decodes_ahead(self) -> bool:
        """Whether a decode round may be launched ahead of the previous one's completion: in a decode probe
        or stretch with at least two rounds left (the round ahead is one of them)."""
        return not self._band.phase.speculates and self._band.left >= 2

    def completed(self, plan: RoundPlan, emitted: int) -> None:
        """``plan`` was applied; its lanes emitted ``emitted`` tokens in all."""
        now = self._clock()
        previous, self._completed_ns = self._completed_ns, now
        speculative = plan.operation == ct.OPERATION_SPECULATIVE
        if not (speculative or plan.decode) or not len(plan):
            return
        band = self._of(len(plan))
        if band.phase in (Phase.PROBE_SPECULATION, Phase.PROBE_DECODE) and speculative == band.phase.speculates:
            band.counted += 1
            if band.counted > 1 and previous is not None:  # a probe's first round drains or refills the frames
                tally = band.speculative if speculative else band.decode
                tally.add((now - previous) / 1e9, emitted / len(plan))
        band.left -= 1
        if band.left <= 0:
            self._advance(band)

    def _advance(self, band: _Band) -> None:
        if band.phase is Phase.PROBE_SPECULATION:
            band.begin(Phase.PROBE_DECODE)
        elif band.phase is Phase.PROBE_DECODE:
            self.rates = (band.speculative.rate(), band.decode.rate())
            faster = Phase.SPECULATE if self.rates[0] > MARGIN * self.rates[1] else Phase.DECODE
            self._choose(
                band, faster, at_least=recheck_stretch(band.speculative, band.decode) if faster is Phase.DECODE else 0
            )
        else:
            band.begin(Phase.PROBE_SPECULATION)


def recheck_stretch(speculative: _Tally, decode: _Tally) -> int:
    """The decode rounds after which a recheck of speculation (:data:`RECHECK_ROUNDS` rounds at the measured
    loss per speculative round: its time less what decode takes for the same tokens) costs
    :data:`PROBE_SHARE` of the stretch's time; 0 without a loss measured."""
    decode_rate = decode.rate()
    if not speculative.rounds or decode_rate <= 0:
        return 0
    loss = (speculative.seconds - speculative.tokens_per_lane / decode_rate) / speculative.rounds
    if loss <= 0:
        return 0
    return math.ceil(round(loss * RECHECK_ROUNDS / (PROBE_SHARE * decode.seconds / decode.rounds), 6))
