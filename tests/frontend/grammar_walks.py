"""Random walks over grammar masks, shared by the grammar tests."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from helios_core.frontend.structured import GrammarMatcher


def allowed(mask: np.ndarray, sampled: int) -> np.ndarray:
    """Ids a Helios grammar mask allows (32-bit words, LSB first), below the sampled size."""
    bits = np.unpackbits(mask.astype("<u4").view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:sampled])


def biased_walk(
    matcher: GrammarMatcher,
    seed: int,
    *,
    eos: int,
    sampled: int,
    favoured: set[int],
    max_steps: int,
    forced: Sequence[int] = (),
) -> list[int]:
    """Sample among allowed ids until EOS is drawn; the ids before EOS.

    ``forced`` ids come first, each as soon as the grammar allows it. Then an allowed ``favoured``
    id (a frame or reasoning delimiter, EOS) is drawn with probability 0.15 at each step, so
    free-text spans end within a bounded walk; otherwise the draw is uniform.
    """
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    pending = list(forced)
    for _ in range(max_steps):
        choices = allowed(matcher.mask(), sampled)
        assert choices.size, "the grammar allowed nothing"
        assert (eos in choices) == matcher.is_accepting
        structural = [int(c) for c in choices if int(c) in favoured]
        if pending and pending[0] in choices:
            token = pending.pop(0)
        else:
            pool = structural if structural and rng.random() < 0.15 else choices
            token = int(rng.choice(pool))
        if token == eos:
            assert matcher.finished or matcher.is_accepting
            return ids
        matcher.advance(token)
        ids.append(token)
    raise AssertionError(f"walk {seed} did not finish in {max_steps} steps")


def uniform_walk(matcher: GrammarMatcher, seed: int, *, eos: int, sampled: int, max_steps: int) -> list[int]:
    """Sample uniformly among allowed ids until EOS is drawn; the ids before EOS."""
    return biased_walk(matcher, seed, eos=eos, sampled=sampled, favoured=set(), max_steps=max_steps)
