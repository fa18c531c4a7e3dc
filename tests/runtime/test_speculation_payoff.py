"""Speculation that pays (``--speculation-payoff``): the measure alternates a probe of each kind of round with a
stretch of the faster kind, measures a round from the previous completion to its own, leaves a probe's first
round out, starts again when the member count changes band, and lets decode rounds run ahead only in a
decode phase. Served on the null backend, the choice follows the measured rates and the output stays that
of decode without speculation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from helios_core.backends.null import NullTokens
from helios_core.contract import LoadOptions
from helios_core.errors import StartupError
from helios_core.loading import TrustSettings
from helios_core.runtime import payoff
from helios_core.runtime.messages import PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.payoff import Phase, SpeculationPayoff, members_band
from helios_core.runtime.plan import RoundPlan
from helios_core.runtime.startup import RunningModel, start
from helios_core.wire import contract_pb2 as ct

from .test_speculative_columns import CYCLE, history_core, null_models  # noqa: F401  (the module's fixtures)


class _Round:
    """What the measure reads of a round plan: its operation and its lanes."""

    def __init__(self, speculative: bool, lanes: int) -> None:
        self.operation = ct.OPERATION_SPECULATIVE if speculative else ct.OPERATION_DECODE
        self.decode = not speculative
        self._lanes = lanes

    def __len__(self) -> int:
        return self._lanes


class _Clock:
    def __init__(self) -> None:
        self.now_ns = 0

    def __call__(self) -> int:
        return self.now_ns


def _complete(
    measure: SpeculationPayoff, clock: _Clock, *, speculative: bool, lanes: int, ms: float, emitted: int
) -> None:
    clock.now_ns += int(ms * 1e6)
    measure.completed(_Round(speculative, lanes), emitted)  # type: ignore[arg-type]


def _cycle(
    measure: SpeculationPayoff, clock: _Clock, lanes: int, speculative_ms: float, tokens: int, decode_ms: float
) -> int:
    """One probe of each kind, rounds of ``lanes`` members costing what the arguments say; how many rounds
    the probe of speculation took."""
    assert measure.speculate(lanes) and measure.phase is Phase.PROBE_SPECULATION
    rounds = 0
    while measure.phase is Phase.PROBE_SPECULATION:
        _complete(measure, clock, speculative=True, lanes=lanes, ms=speculative_ms, emitted=tokens * lanes)
        rounds += 1
    assert not measure.speculate(lanes) and measure.phase is Phase.PROBE_DECODE
    for _ in range(payoff.PROBE_ROUNDS):
        _complete(measure, clock, speculative=False, lanes=lanes, ms=decode_ms, emitted=lanes)
    return rounds


def test_a_measurement_chooses_decode_when_speculative_rounds_emit_fewer_tokens_a_second() -> None:
    clock, stretches = _Clock(), {}
    measure = SpeculationPayoff(stretches, clock)
    _cycle(measure, clock, lanes=4, speculative_ms=2.2, tokens=2, decode_ms=1.0)
    assert measure.phase is Phase.DECODE and stretches == {"decode": 1}
    assert measure.rates == pytest.approx((2 / 0.0022, 1 / 0.001))
    assert not measure.speculate(4)
    ahead = []
    for _ in range(payoff.STRETCH_ROUNDS):
        ahead.append(measure.decodes_ahead())
        _complete(measure, clock, speculative=False, lanes=4, ms=1.0, emitted=4)
    assert ahead == [True] * (payoff.STRETCH_ROUNDS - 1) + [False]  # the last round of a stretch runs alone
    assert measure.phase is Phase.PROBE_SPECULATION and measure.speculate(4)
    for _ in range(payoff.RECHECK_ROUNDS):  # after decode won, speculation is probed with fewer rounds
        _complete(measure, clock, speculative=True, lanes=4, ms=3.0, emitted=8)
    assert measure.phase is Phase.PROBE_DECODE
    for _ in range(payoff.PROBE_ROUNDS):
        _complete(measure, clock, speculative=False, lanes=4, ms=1.0, emitted=4)
    assert measure.rates == pytest.approx((2 / 0.003, 1 / 0.001))  # the recheck's second round was measured
    assert measure.phase is Phase.DECODE and stretches == {"decode": 2}


def test_a_measurement_chooses_speculation_when_it_emits_more_tokens_a_second() -> None:
    clock, stretches = _Clock(), {}
    measure = SpeculationPayoff(stretches, clock)
    _cycle(measure, clock, lanes=1, speculative_ms=1.5, tokens=3, decode_ms=1.0)
    assert measure.phase is Phase.SPECULATE and stretches == {"speculate": 1}
    assert measure.rates == pytest.approx((3 / 0.0015, 1 / 0.001))
    assert measure.speculate(1) and not measure.decodes_ahead()


def test_a_probes_first_round_and_rounds_of_other_kinds_or_bands_are_not_measured() -> None:
    clock, stretches = _Clock(), {}
    measure = SpeculationPayoff(stretches, clock)
    assert measure.speculate(4)
    _complete(measure, clock, speculative=True, lanes=4, ms=500.0, emitted=4)  # the first: drains the frames
    _complete(measure, clock, speculative=False, lanes=4, ms=7.0, emitted=4)  # no proposals: a decode round
    _complete(measure, clock, speculative=True, lanes=16, ms=9.0, emitted=16)  # another band: not counted
    for _ in range(payoff.PROBE_ROUNDS - 2):  # the round of another band was not one of the probe's
        _complete(measure, clock, speculative=True, lanes=4, ms=2.0, emitted=8)
    assert measure.phase is Phase.PROBE_DECODE
    _complete(measure, clock, speculative=False, lanes=4, ms=300.0, emitted=4)  # the first: refills the frames
    for _ in range(payoff.PROBE_ROUNDS - 1):
        _complete(measure, clock, speculative=False, lanes=4, ms=1.0, emitted=4)
    assert measure.rates == pytest.approx((2 / 0.002, 1 / 0.001))
    assert measure.phase is Phase.DECODE  # a tie goes to decode: it runs two frames deep


@pytest.mark.parametrize(("speculative_ms", "chosen"), [(0.96, Phase.DECODE), (0.9, Phase.SPECULATE)])
def test_speculation_must_lead_decode_by_the_margin(speculative_ms: float, chosen: Phase) -> None:
    clock, stretches = _Clock(), {}
    measure = SpeculationPayoff(stretches, clock)
    _cycle(measure, clock, lanes=2, speculative_ms=speculative_ms, tokens=1, decode_ms=1.0)
    assert measure.phase is chosen


def test_each_band_of_member_counts_keeps_its_own_cycle() -> None:
    clock, stretches = _Clock(), {}
    measure = SpeculationPayoff(stretches, clock)
    _cycle(measure, clock, lanes=5, speculative_ms=1.5, tokens=3, decode_ms=1.0)
    assert measure.speculate(8) and measure.phase is Phase.SPECULATE  # 5 and 8 share a band: its stretch
    assert measure.speculate(3) and measure.phase is Phase.PROBE_SPECULATION  # a new band probes first
    _cycle(measure, clock, lanes=3, speculative_ms=3.0, tokens=2, decode_ms=1.0)
    assert not measure.speculate(4) and measure.phase is Phase.DECODE  # 3 and 4: the decode stretch
    assert measure.speculate(6) and measure.phase is Phase.SPECULATE  # the band of 5 to 8 resumes its stretch
    _complete(measure, clock, speculative=False, lanes=4, ms=1.0, emitted=4)  # counts towards its own band
    assert measure.speculate(7) and measure.phase is Phase.SPECULATE
    assert measure.speculate(9) and measure.phase is Phase.PROBE_SPECULATION  # above a speculating band: probes


def test_a_new_band_above_one_that_chose_decode_starts_with_a_stretch_as_long_as_its_last() -> None:
    """Speculation pays less as the batch grows: a band whose nearest smaller band that has chosen chose
    decode starts with a decode stretch of that band's length; a smaller new band still probes."""
    clock, stretches = _Clock(), {}
    measure = SpeculationPayoff(stretches, clock)
    _cycle(measure, clock, lanes=4, speculative_ms=3.0, tokens=2, decode_ms=1.0)
    assert stretches == {"decode": 1}
    assert not measure.speculate(200) and measure.phase is Phase.DECODE and stretches == {"decode": 2}
    assert _stretch(measure, clock, 200, speculative=False) == payoff.recheck_stretch(
        _tally(3.0, 2, payoff.PROBE_ROUNDS - 1), _tally(1.0, 1, payoff.PROBE_ROUNDS - 1)
    )
    assert measure.speculate(200) and measure.phase is Phase.PROBE_SPECULATION  # then it rechecks its own
    assert measure.speculate(1) and measure.phase is Phase.PROBE_SPECULATION  # a smaller band probes first
    assert not measure.speculate(16) and measure.phase is Phase.DECODE  # above the band of 4 again


def _stretch(measure: SpeculationPayoff, clock: _Clock, lanes: int, *, speculative: bool) -> int:
    """Complete rounds of one kind until the band's stretch ends; how many it took."""
    rounds = 0
    while measure.phase in (Phase.SPECULATE, Phase.DECODE):
        _complete(measure, clock, speculative=speculative, lanes=lanes, ms=1.0, emitted=lanes)
        rounds += 1
        measure.speculate(lanes)
    return rounds


def test_a_stretch_doubles_each_time_the_same_kind_wins_again_up_to_its_growth_limit() -> None:
    clock, stretches = _Clock(), {}
    measure = SpeculationPayoff(stretches, clock)
    lengths, probes = [], []
    for _ in range(7):  # a loss of 0.2 ms a speculative round: the recheck alone needs no longer stretch
        probes.append(_cycle(measure, clock, lanes=64, speculative_ms=4.2, tokens=4, decode_ms=1.0))
        lengths.append(_stretch(measure, clock, 64, speculative=False))
    base, limit = payoff.STRETCH_ROUNDS, payoff.STRETCH_ROUNDS * payoff.STRETCH_GROWTH
    assert lengths == [min(base * 2**n, limit) for n in range(7)]
    assert probes == [payoff.PROBE_ROUNDS] + [payoff.RECHECK_ROUNDS] * 6  # after decode won: a short recheck
    _cycle(measure, clock, lanes=64, speculative_ms=2.0, tokens=4, decode_ms=1.0)  # speculation wins: anew
    assert _stretch(measure, clock, 64, speculative=True) == base
    assert stretches == {"decode": 7, "speculate": 1}


def _tally(ms: float, tokens: int, rounds: int) -> payoff._Tally:
    tally = payoff._Tally()
    for _ in range(rounds):
        tally.add(ms / 1e3, tokens)
    return tally


@pytest.mark.parametrize(
    ("speculative_ms", "tokens", "rounds"),
    [(8.0, 2, 600), (4.2, 4, 20), (2.0, 2, 0), (30.0, 2, 2800)],
)
def test_a_recheck_costs_the_probe_share_of_the_decode_stretch_before_it(
    speculative_ms: float, tokens: int, rounds: int
) -> None:
    """Decode at 1 ms a round: a speculative round of ``speculative_ms`` emitting ``tokens`` a lane loses
    ``speculative_ms - tokens`` ms; a recheck of two such rounds is 2 % of ``rounds`` decode rounds."""
    assert payoff.recheck_stretch(_tally(speculative_ms, tokens, 3), _tally(1.0, 1, 3)) == rounds
    assert payoff.recheck_stretch(payoff._Tally(), _tally(1.0, 1, 3)) == 0  # no speculative round: no loss


def test_a_decode_stretch_holds_the_recheck_of_its_measured_loss_up_to_the_longest_stretch() -> None:
    clock, stretches = _Clock(), {}
    measure = SpeculationPayoff(stretches, clock)
    _cycle(measure, clock, lanes=256, speculative_ms=8.0, tokens=2, decode_ms=1.0)
    assert _stretch(measure, clock, 256, speculative=False) == 600
    recheck = _cycle(measure, clock, lanes=256, speculative_ms=8.0, tokens=2, decode_ms=1.0)
    assert recheck == payoff.RECHECK_ROUNDS
    assert recheck * (8.0 - 2 * 1.0) <= payoff.PROBE_SHARE * 600 * 1.0  # the recheck lost 2 % of the stretch
    assert _stretch(measure, clock, 256, speculative=False) == 600  # doubling (128) stays below it
    _cycle(measure, clock, lanes=256, speculative_ms=30.0, tokens=2, decode_ms=1.0)
    assert _stretch(measure, clock, 256, speculative=False) == payoff.MAX_STRETCH_ROUNDS


@pytest.mark.parametrize(("members", "band"), [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (256, 8)])
def test_member_counts_fall_in_bands_of_powers_of_two(members: int, band: int) -> None:
    assert members_band(members) == band


# -- served on the null backend --------------------------------------------------------------------------


@pytest.fixture
def serve(null_models: Callable[..., RunningModel], monkeypatch: pytest.MonkeyPatch) -> Callable[..., RunningModel]:  # noqa: F811
    monkeypatch.setattr(payoff, "PROBE_ROUNDS", 3)
    monkeypatch.setattr(payoff, "STRETCH_ROUNDS", 8)
    return null_models


def _tokens(model: RunningModel, work: list[PreparedRequest]) -> dict[str, list[int]]:
    streams = [model.engine.submit(request) for request in work]
    return {stream.request_id: [e.token_id for e in stream if isinstance(e, TokenEvent)] for stream in streams}


def _work(tokens: NullTokens, vocabulary: int) -> list[PreparedRequest]:
    return [
        PreparedRequest(
            f"r{i}", tokens.ids(np.arange(2 * CYCLE, dtype=np.int64), vocabulary).tolist(), 140, SamplingParams()
        )
        for i in range(4)
    ]


@pytest.mark.parametrize(("speculative_ms", "faster"), [(2.0, "speculate"), (20.0, "decode")])
def test_served_rounds_follow_the_measured_rates_and_serve_the_output_of_decode(
    serve: object, speculative_ms: float, faster: str
) -> None:
    """The clock the measure reads advances 1 ms a decode round and ``speculative_ms`` a speculative one.
    On the null backend's cycle every proposal holds, so a speculative round emits up to 8 tokens a lane:
    faster than decode at 2 ms, slower at 20 ms. Either way the probes run both kinds (decode probes run
    ahead, two frames deep), a decode stretch runs ahead too, and the tokens are decode's."""
    tokens = NullTokens(cycle=CYCLE)
    plain = serve(tokens, max_active=4)  # type: ignore[operator]
    vocabulary = plain.engine.model.contract.sampled_size
    expected = _tokens(plain, _work(tokens, vocabulary))
    model = serve(tokens, max_active=4, history_drafting=True, speculation_payoff=True)  # type: ignore[operator]
    measure = model.engine.scheduler.planner.speculation.payoff
    assert measure is not None
    clock = _Clock()
    measure._clock = clock
    completed = measure.completed

    def charged(plan: RoundPlan, emitted: int) -> None:
        speculative = plan.operation == ct.OPERATION_SPECULATIVE
        clock.now_ns += int((speculative_ms if speculative else 1.0) * 1e6)
        completed(plan, emitted)

    measure.completed = charged  # type: ignore[method-assign]
    assert _tokens(model, _work(tokens, vocabulary)) == expected
    statistics = model.engine.statistics()
    assert set(statistics.speculation_stretches) == {faster}
    assert sum(statistics.speculative_lanes.values()) > 0 and statistics.pipelined_rounds > 0
    if faster == "decode":
        assert statistics.pipelined_rounds >= payoff.STRETCH_ROUNDS - 1  # a whole stretch ran ahead
    else:
        assert statistics.pipelined_rounds < payoff.STRETCH_ROUNDS - 1  # only decode probes ran ahead


def test_the_payoff_measure_needs_speculative_programs(history_core: tuple[Path, TrustSettings]) -> None:  # noqa: F811
    with pytest.raises(StartupError, match="the speculation payoff measure needs speculative programs wider than one"):
        start(*history_core, LoadOptions(speculation_payoff=True, speculative_width=1), backend="null")


def test_the_payoff_measure_needs_rounds_that_speculate(history_core: tuple[Path, TrustSettings]) -> None:  # noqa: F811
    """A core whose speculative programs verify copied proposals speculates only with history drafting: the
    measure without it is refused instead of measuring nothing."""
    with pytest.raises(StartupError, match="only --history-drafting makes"):
        start(*history_core, LoadOptions(speculation_payoff=True), backend="null")
    model = start(*history_core, LoadOptions(speculation_payoff=True, history_drafting=True), backend="null")
    try:
        assert model.engine.scheduler.planner.speculation.payoff is not None
    finally:
        model.close()
