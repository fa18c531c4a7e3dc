"""The n-gram index of history drafting against :func:`propose`, its specification, on random histories
that grow round by round, slots that change hands, and ids too wide for its keys."""

from __future__ import annotations

import numpy as np
import pytest

from helios_core.runtime import drafting
from helios_core.runtime.drafting import HistoryIndex, propose

SLOTS, CONTEXT = 6, 96


def expected(
    tokens: np.ndarray, slots: list[int], lengths: list[int], limits: list[int], width: int, **sizes: int
) -> list[list[int]]:
    return [
        propose(tokens[slot, :length], min(limit, width), **sizes)
        for slot, length, limit in zip(slots, lengths, limits, strict=True)
    ]


def found(proposals: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    return [row[:count].tolist() for row, count in zip(proposals, counts.tolist(), strict=True)]


def ask(
    index: HistoryIndex, slots: list[int], generations: np.ndarray, lengths: list[int], limits: list[int], width: int
) -> tuple[np.ndarray, np.ndarray]:
    as_array = np.asarray(slots, dtype=np.int64)
    return index.propose(
        as_array,
        generations[as_array],
        np.asarray(lengths, dtype=np.int64),
        np.asarray(limits, dtype=np.int64),
        width,
    )


def grow_and_compare(vocabulary: int, min_ngram: int, max_ngram: int, seed: int, tail: int = 48) -> HistoryIndex:
    """Histories that grow round by round (a slot now and then taken by a new holder), asked of one index
    and of :func:`propose` each round; the index."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((SLOTS, CONTEXT), dtype=np.int32)
    tokens[:] = rng.integers(0, vocabulary, size=tokens.shape)
    index = HistoryIndex(tokens, max_ngram=max_ngram, min_ngram=min_ngram, tail=tail)
    generations = np.arange(1, SLOTS + 1, dtype=np.int64)
    lengths = rng.integers(0, 4, size=SLOTS)
    for round_ in range(40):
        lengths = np.minimum(lengths + rng.integers(0, 5, size=SLOTS), CONTEXT)
        slots = sorted(rng.choice(SLOTS, size=rng.integers(1, SLOTS + 1), replace=False).tolist())
        limits = rng.integers(-1, 9, size=len(slots)).tolist()
        width = int(rng.integers(1, 8))
        chosen = [int(lengths[slot]) for slot in slots]
        proposals, counts = ask(index, slots, generations, chosen, limits, width)
        sizes = {"max_ngram": max_ngram, "min_ngram": min_ngram}
        assert found(proposals, counts) == expected(tokens, slots, chosen, limits, width, **sizes), round_
        assert (proposals[np.arange(width) >= counts[:, None]] == -1).all()
        if round_ % 7 == 6:  # a slot changes hands: a new generation with a new history
            slot = int(rng.integers(0, SLOTS))
            generations[slot] += SLOTS
            tokens[slot] = rng.integers(0, vocabulary, size=CONTEXT)
            lengths[slot] = int(rng.integers(0, 6))
    return index


@pytest.mark.parametrize("vocabulary", [2, 3, 5, 12])
@pytest.mark.parametrize(("min_ngram", "max_ngram"), [(1, 3), (2, 3), (1, 1), (1, 4)])
@pytest.mark.parametrize("tail", [1, 6, 48])  # rows taken by the table every round, now and then, rarely
def test_the_index_proposes_what_propose_finds_as_histories_grow(
    vocabulary: int, min_ngram: int, max_ngram: int, tail: int
) -> None:
    grow_and_compare(vocabulary, min_ngram, max_ngram, seed=vocabulary * 10 + max_ngram, tail=tail)


@pytest.mark.parametrize("vocabulary", [3, 12])
@pytest.mark.parametrize("tail", [1, 6])
def test_colliding_keys_still_give_what_propose_finds(
    vocabulary: int, tail: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a hash of three values: most n-grams share their key with others of the same or another slot
    monkeypatch.setattr(drafting, "_mix", lambda chain, ids: (chain + ids) % 3)  # keys 1 and 3 only
    grow_and_compare(vocabulary, 1, 3, seed=vocabulary, tail=tail)


def test_a_table_half_taken_is_emptied_made_larger_and_filled_again(monkeypatch: pytest.MonkeyPatch) -> None:
    emptied: list[int] = []
    empty = HistoryIndex._empty

    def counted(index: HistoryIndex, capacity: int) -> None:
        emptied.append(capacity)
        empty(index, capacity)

    monkeypatch.setattr(HistoryIndex, "_empty", counted)
    rng = np.random.default_rng(3)
    tokens = np.zeros((2, 40), dtype=np.int32)
    tokens[1] = rng.integers(0, 5, size=40)
    index = HistoryIndex(tokens, capacity=16, tail=2)
    for holder in range(1, 9):  # slot 0 changes hands after every history; slot 1 keeps its holder
        tokens[0] = rng.integers(0, 30, size=40)
        for length in range(2, 40, 3):
            generations = np.array([holder, 100])
            lengths, limits = [length, min(holder * 3 + length // 8, 40)], [4, 4]
            assert found(*ask(index, [0, 1], generations, lengths, limits, 4)) == expected(
                tokens, [0, 1], lengths, limits, 4
            )
    assert emptied[0] >= 8 * 3 * 2  # made larger at once: eight times what was to be indexed
    assert len(emptied) > 2  # and emptied again as the former holders' entries took a quarter of it
    assert index.taken <= index.keys.shape[0] // 4


def test_a_history_shorter_than_what_was_indexed_is_indexed_again() -> None:
    tokens = np.zeros((1, 16), dtype=np.int32)
    tokens[0, :8] = [1, 2, 3, 1, 2, 3, 1, 2]
    index = HistoryIndex(tokens)
    generations = np.array([5], dtype=np.int64)
    assert found(*ask(index, [0], generations, [8], [4], 4)) == [[3, 1, 2, 3]]  # the loop repeats on
    tokens[0, :5] = [7, 6, 5, 7, 6]  # the same holder, a shorter and different history
    assert found(*ask(index, [0], generations, [5], [4], 4)) == [[5, 7, 6, 5]]


def test_wide_ids_are_proposed_alike() -> None:
    wide = 2**40
    tokens = np.array([[wide - 1, 7, wide - 1, 7, wide - 1, 0]], dtype=np.int64)
    index = HistoryIndex(tokens)
    assert found(*ask(index, [0], np.array([1], dtype=np.int64), [5], [3], 3)) == [[7, wide - 1, 7]]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"max_ngram": 2, "min_ngram": 3}, "n-gram sizes must satisfy 1 <= min (3) <= max (2)"),
        ({"min_ngram": 0}, "n-gram sizes must satisfy 1 <= min (0) <= max (3)"),
    ],
)
def test_bad_sizes_are_refused_by_name(arguments: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        HistoryIndex(np.zeros((1, 4), dtype=np.int32), **arguments)


def test_a_capacity_not_a_power_of_two_or_an_empty_tail_is_refused() -> None:
    with pytest.raises(ValueError, match="the table's capacity must be a power of two of at least 2, got 12"):
        HistoryIndex(np.zeros((1, 4), dtype=np.int32), capacity=12)
    with pytest.raises(ValueError, match="the unindexed tail must be at least one position, got 0"):
        HistoryIndex(np.zeros((1, 4), dtype=np.int32), tail=0)
