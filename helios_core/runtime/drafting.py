"""History drafting: proposals copied from a request's own prompt and output.

Owns :func:`propose`, the host drafter of speculative rounds (prompt lookup): the longest suffix of the
request's tokens, of at most ``MAX_NGRAM`` and at least ``MIN_NGRAM`` tokens, that occurred earlier in
them, and the tokens that followed its most recent earlier occurrence. The planner copies what it
returns into a speculative program's candidate inputs; the target verifies them, so a proposal only
ever costs verification rows, never correctness.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

MAX_NGRAM = 3
"""The longest suffix looked up."""
MIN_NGRAM = 1
"""The shortest suffix looked up."""


def propose(
    tokens: npt.NDArray[np.integer] | list[int],
    limit: int,
    *,
    max_ngram: int = MAX_NGRAM,
    min_ngram: int = MIN_NGRAM,
) -> list[int]:
    """At most ``limit`` tokens that followed the most recent earlier occurrence of the longest suffix of
    ``tokens`` (``max_ngram`` down to ``min_ngram`` tokens long) found earlier in ``tokens``; [] when no
    suffix recurs or ``limit`` is not positive."""
    if limit <= 0:
        return []
    history = np.asarray(tokens)
    length = history.shape[0]
    for size in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = history[length - size :]
        # earlier starts of the whole suffix (each one followed by at least one token)
        match = history[: length - size] == suffix[0]
        for offset in range(1, size):
            match &= history[offset : length - size + offset] == suffix[offset]
        starts = np.flatnonzero(match)
        if starts.shape[0]:
            start = int(starts[-1])  # the most recent
            return history[start + size : start + size + limit].tolist()  # type: ignore[no-any-return]
    return []
