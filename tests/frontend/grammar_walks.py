"""Random walks over grammar masks, shared by the grammar tests."""

from __future__ import annotations

import numpy as np

from helios_core.frontend.structured import GrammarMatcher


def allowed(mask: np.ndarray, sampled: int) -> np.ndarray:
    """Ids a Helios grammar mask allows (32-bit words, LSB first), below the sampled size."""
    bits = np.unpackbits(mask.astype("<u4").view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:sampled])


def uniform_walk(matcher: GrammarMatcher, seed: int, *, eos: int, sampled: int, max_steps: int) -> list[int]:
    """Sample uniformly among allowed ids until EOS is drawn; the ids before EOS."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    for _ in range(max_steps):
        choices = allowed(matcher.mask(), sampled)
        assert choices.size, "the grammar allowed nothing"
        assert (eos in choices) == matcher.is_accepting
        token = int(rng.choice(choices))
        if token == eos:
            assert matcher.finished
            return ids
        matcher.advance(token)
        ids.append(token)
    raise AssertionError(f"walk {seed} did not finish in {max_steps} steps")


def biased_walk(
    matcher: GrammarMatcher, seed: int, *, eos: int, sampled: int, favoured: set[int], max_steps: int
) -> list[int]:
    """Like :func:`uniform_walk`, but an allowed ``favoured`` id (a frame or reasoning delimiter, EOS)
    is drawn with probability 0.15 at each step, so free-text spans end within a bounded walk."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    for _ in range(max_steps):
        choices = allowed(matcher.mask(), sampled)
        assert choices.size, "the grammar allowed nothing"
        assert (eos in choices) == matcher.is_accepting
        structural = [int(c) for c in choices if int(c) in favoured]
        pool = structural if structural and rng.random() < 0.15 else choices
        token = int(rng.choice(pool))
        if token == eos:
            assert matcher.finished or matcher.is_accepting
            return ids
        matcher.advance(token)
        ids.append(token)
    raise AssertionError(f"walk {seed} did not finish in {max_steps} steps")
