"""History drafting: proposals copied from a request's own prompt and output.

Owns :func:`propose`, the host drafter of speculative rounds (prompt lookup): the longest suffix of the
request's tokens, of at most ``MAX_NGRAM`` and at least ``MIN_NGRAM`` tokens, that occurred earlier in
them, and the tokens that followed its most recent earlier occurrence (repeating that stretch where it
runs into the end of the history: a loop is proposed on). The planner copies what it
returns into a speculative program's candidate inputs; the target verifies them, so a proposal only
ever costs verification rows, never correctness.

:func:`propose` is the specification: it scans the whole history. :class:`HistoryIndex` gives the same
proposals for many requests at once without scanning a history: a hash table maps each n-gram a slot's
history holds, followed by a token, to its most recent start, and the last few dozen positions of each
history (what the table has not taken yet) are compared directly; the table takes a row's new positions
in bulk, once some row has gained more than that many (a request's history only grows while it holds
its slot; a new holder of the slot, or a shorter history, starts the slot's entries again). The table
holds ``MAX_NGRAM - MIN_NGRAM + 1`` entries per history token of the slots it has seen, in two int64
arrays of four to eight times as many buckets (16 bytes each).
"""

from __future__ import annotations

from typing import cast

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
    """``limit`` tokens that followed the most recent earlier occurrence of the longest suffix of ``tokens``
    (``max_ngram`` down to ``min_ngram`` tokens long) found earlier in ``tokens``; [] when no suffix recurs
    or ``limit`` is not positive.

    Where fewer than ``limit`` tokens follow the occurrence (it lies within the last ``limit`` tokens),
    the copy goes on through the tokens it has already copied, as an overlapping copy does: the stretch
    from the occurrence to the end repeats. A history that has fallen into a loop (``a b c a b c a``) is
    then proposed the loop's continuation for the whole ``limit`` (``b c a b c ...``), not one turn of it.
    """
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
            # what followed it, copied on through the copy itself where it runs into the history's end (a
            # repeating stretch repeats on: ``np.resize`` tiles the run out to ``limit`` tokens)
            return np.resize(history[start + size : start + size + limit], limit).tolist()  # type: ignore[no-any-return]
    return []


class HistoryIndex:
    """:func:`propose` for the requests of many slots at once, from an n-gram table kept up to date.

    ``tokens`` is the slot table's token matrix (``slots x context``, each row a request's prompt and
    output in position order). An open-addressing hash table (numpy arrays, double hashing: the key's
    high half gives its odd step) maps a key of (generation, n-gram) to the most recent start of that
    n-gram followed by a token in the first
    ``indexed[slot]`` tokens of the slot the generation holds, tagged with the generation (``start +
    generation x 2**32``), for every n-gram size ``min_ngram`` to ``max_ngram``; an entry added again
    keeps the larger value (the later start). A key is a 64-bit hash (the generation, then the n-gram's
    ids from its last one back), so two n-grams may share one and one entry then stands for both: a
    lookup takes an entry only when its generation is the lane's and its start is followed by a token of
    the lane's history with the suffix's ids, and scans the lane's history with :func:`propose` when the
    entry it finds is another's (which may stand for the suffix's own). No entry is ever removed alone:
    when a quarter of the table is taken, it is emptied (made larger when what the slots index needs it)
    and every slot is indexed again when next asked about, so a key without an entry has none of its
    own.

    :meth:`propose` first has the table take every lane's new positions when some lane has gained more
    than ``tail`` since the table last took its row (all of its row for a slot held by a new generation,
    or whose history is shorter than what was indexed). It then looks each lane's suffixes up, all sizes
    at once, among the starts the table holds and, by comparing the lane's last ``tail + max_ngram``
    tokens, among the later ones; the longest suffix with an occurrence or an entry decides, and an
    occurrence among the later starts is the more recent.
    """

    def __init__(
        self,
        tokens: npt.NDArray[np.integer],
        *,
        max_ngram: int = MAX_NGRAM,
        min_ngram: int = MIN_NGRAM,
        capacity: int = 1 << 12,
        tail: int = 48,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min ({min_ngram}) <= max ({max_ngram})")
        if tokens.ndim != 2:
            raise ValueError(f"the token matrix must be slots x context, got shape {tokens.shape}")
        if capacity < 2 or capacity & (capacity - 1):
            raise ValueError(f"the table's capacity must be a power of two of at least 2, got {capacity}")
        if tail < 1:
            raise ValueError(f"the unindexed tail must be at least one position, got {tail}")
        self.tokens = tokens
        self.cells = tokens.reshape(-1)
        self.width = tokens.shape[1]
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._sizes = np.arange(max_ngram, min_ngram - 1, -1, dtype=np.int64)
        """The n-gram sizes, longest first (the order of a lookup's rows)."""
        slots = tokens.shape[0]
        self.keys = np.zeros(capacity, dtype=np.int64)
        """Each bucket's key (0: empty; keys are odd)."""
        self.values = np.full(capacity, -1, dtype=np.int64)
        self.taken = 0
        """At least the buckets taken (each claim counts, though two may claim one bucket together)."""
        self.indexed = np.zeros(slots, dtype=np.int64)
        """Per slot: the history length whose followed n-grams are all in the table."""
        self.generation = np.full(slots, -1, dtype=np.int64)
        """Per slot: the generation its entries belong to (-1: none yet)."""
        self._checked: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None = None
        """The (slots, generations) arrays last checked for new holders (the planner's, while unchanged)."""
        self.tail = tail
        """The most positions a row may gain before the table takes them (their n-grams are found by
        comparing the row's last ``tail + max_ngram`` tokens meanwhile)."""
        self._back = np.arange(-max_ngram, 0, dtype=np.int64)
        """Offsets of the ``max_ngram`` tokens before a position."""
        self._recent = np.arange(-(tail + max_ngram), 0, dtype=np.int64)
        """Offsets of a lane's last ``tail + max_ngram`` tokens from the end of its history."""
        self._ks = np.arange(tail, dtype=np.int64)
        """Column ``t`` of a window of recent starts stands for ``k = tail - t`` positions back."""
        self._window = np.arange(max_ngram, dtype=np.int64)
        """Offsets of an n-gram's tokens from its start (the first ``size`` of them)."""
        self._beyond = self._window >= self._sizes[:, None, None]
        """Per size (longest first): the window offsets past the n-gram (never compared)."""
        longest = self._sizes[:, None]
        self._suffix_columns = tail + max_ngram - longest + np.minimum(self._window, longest - 1)
        """Per size: which of a lane's recent tokens is the suffix's token at each offset."""

    def propose(
        self,
        slots: npt.NDArray[np.int64],
        generations: npt.NDArray[np.int64],
        lengths: npt.NDArray[np.int64],
        limits: npt.NDArray[np.int64],
        width: int,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """For lane ``i`` (slot ``slots[i]``, held by ``generations[i]``, history the first ``lengths[i]``
        tokens of its row): ``propose(history, min(limits[i], width))``, as a row of ``[lanes, width]``
        proposals (-1 past its count) and its count. Slots are distinct; arrays handed in again unchanged
        (the same objects) are taken to name the same holders."""
        count = slots.shape[0]
        if not count or width <= 0:
            return np.full((count, max(width, 0)), -1, dtype=np.int64), np.zeros(count, dtype=np.int64)
        self._renew(slots, generations)
        unindexed = lengths - self.indexed[slots]
        if (unindexed > self.tail).any() or (unindexed < 0).any():  # the table first takes what the rows gained
            self._catch_up(slots, generations, lengths)
            unindexed = np.zeros_like(unindexed)
        cells, largest, sizes = self.cells, self.max_ngram, self._sizes[:, None]
        rows = slots * self.width
        ends = rows + lengths  # one past each lane's last token
        # each lane's last ``tail + largest`` tokens (repeating its first token where the history is shorter)
        recent = cells[np.maximum(ends[:, None] + self._recent, rows[:, None])]
        # the suffixes' most recent occurrences among the starts the table does not hold yet
        near_found, near_starts = self._near(recent, lengths, unindexed)
        # the suffixes' keys (a chain over the last ids, last first), one row a size, longest first
        chain = generations * _SEED_MULTIPLIER + _SEED_MULTIPLIER
        chains: list[npt.NDArray[np.int64]] = []
        for size in range(1, largest + 1):
            chain = _mix(chain, recent[:, -size])
            if size >= self.min_ngram:
                chains.append(chain)
        chains.reverse()
        values = self._find(np.concatenate(chains) | 1).reshape(len(chains), count)
        asked = (lengths > sizes) & (limits > 0)  # a suffix the history has, of a lane that offers
        entered = (values >= 0) & asked
        starts = values & _START_MASK
        ours = entered & (values >> _OWNER_SHIFT == generations) & (starts + sizes < lengths)
        held = cells[np.where(ours, rows + starts, 0)[:, :, None] + self._window]
        ours &= ((held == recent[:, self._suffix_columns].transpose(1, 0, 2)) | self._beyond).all(axis=2)
        near_found &= asked
        present = near_found | entered
        deciding = present.argmax(axis=0)  # the longest suffix with an occurrence or an entry
        lanes = np.arange(count)
        decided = present[deciding, lanes]
        near = near_found[deciding, lanes]
        taken = decided & (near | ours[deciding, lanes])
        start = np.where(near, near_starts[deciding, lanes], starts[deciding, lanes])
        first = start + self._sizes[deciding]  # the first token after the occurrence
        counts = np.where(taken, np.minimum(limits, width), 0)
        columns = np.arange(width, dtype=np.int64)
        valid = columns < counts[:, None]
        run = np.maximum(lengths - first, 1)[:, None]  # what followed the occurrence, tiled past the history's end
        proposals = np.where(valid, cells[np.where(valid, rows[:, None] + first[:, None] + columns % run, 0)], -1)
        for lane in np.flatnonzero(decided & ~taken).tolist():  # another's entry: it may stand for the suffix's own
            slot, length, limit = int(slots[lane]), int(lengths[lane]), min(int(limits[lane]), width)
            found = propose(self.tokens[slot, :length], limit, max_ngram=largest, min_ngram=self.min_ngram)
            proposals[lane, : len(found)] = found
            counts[lane] = len(found)
        return proposals, counts

    def _near(
        self, recent: npt.NDArray[np.integer], lengths: npt.NDArray[np.int64], unindexed: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int64]]:
        """Per size (longest first) and lane: whether its suffix occurs at a start whose follower the table
        does not hold yet (within the last ``unindexed`` positions), and the most recent such start.

        ``recent`` holds each lane's last ``tail + max_ngram`` tokens; the start ``length - size - k``
        (``k`` = 1 .. ``tail``) is followed by position ``length - k``, outside the table when ``k`` is at
        most ``unindexed``, and lies in the history when ``k`` is at most ``length - size``."""
        tail, largest = self.tail, self.max_ngram
        span = tail + largest
        # matches[n][:, j]: the n tokens from column j of ``recent`` are the suffix of size n (built from the
        # last token back: a size-n match is a match of its first token and a size n - 1 match after it)
        match = recent == recent[:, span - 1, None]
        windows: list[npt.NDArray[np.bool_]] = []
        for size in range(1, largest + 1):
            if size > 1:
                match = (recent[:, : span - size + 1] == recent[:, span - size, None]) & match[:, 1:]
            if size >= self.min_ngram:  # column t of a window: the start length - size - (tail - t)
                windows.append(match[:, largest - size : largest - size + tail])
        windows.reverse()
        found = np.stack(windows)
        sizes = self._sizes[:, None]
        found &= self._ks >= (tail - np.minimum(unindexed, lengths - sizes))[:, :, None]
        latest = tail - 1 - found[:, :, ::-1].argmax(axis=2)
        return cast("npt.NDArray[np.bool_]", found.any(axis=2)), lengths - sizes - (tail - latest)

    def _renew(self, slots: npt.NDArray[np.int64], generations: npt.NDArray[np.int64]) -> None:
        """A slot held by another generation than its entries': nothing of its row is indexed."""
        checked = self._checked
        if checked is None or checked[0] is not slots or checked[1] is not generations:
            renewed = self.generation[slots] != generations
            if renewed.any():
                self.generation[slots[renewed]] = generations[renewed]
                self.indexed[slots[renewed]] = 0
            self._checked = (slots, generations)

    def _catch_up(
        self, slots: npt.NDArray[np.int64], generations: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]
    ) -> None:
        """Add to the table the n-grams each lane's row made followed in its first ``lengths`` tokens since
        it was last brought up to date (all of them for a shorter history than was indexed)."""
        indexed = self.indexed[slots]
        if (indexed > lengths).any():  # a shorter history than was indexed: indexed again from its start
            indexed = np.where(indexed > lengths, 0, indexed)
        added = lengths - indexed
        total = int(added.sum())
        if not total:
            return
        sizes = self._sizes.shape[0]
        capacity = self.keys.shape[0]
        if _FULL * (self.taken + sizes * total) > capacity:  # the table would be too full: emptied first
            live = sizes * (int(self.indexed.sum()) + int(lengths.sum()))
            while capacity < 2 * _FULL * live:
                capacity *= 2
            self._empty(capacity)
            indexed = np.zeros_like(indexed)
            added = lengths
            total = int(added.sum())
        self.indexed[slots] = lengths
        # every new follower position p of each lane, lane by lane, ascending: the n-grams ending at p - 1
        followers = np.arange(total, dtype=np.int64) + np.repeat(indexed - np.cumsum(added) + added, added)
        rows = np.repeat(slots * self.width, added)
        largest = self.max_ngram
        # the ``largest`` tokens before each follower (repeating its row's first token near the row's start)
        before = self.cells[rows[:, None] + np.maximum(followers[:, None] + self._back, 0)]
        chain = np.repeat(generations * _SEED_MULTIPLIER + _SEED_MULTIPLIER, added)
        chains: list[npt.NDArray[np.int64]] = []
        for size in range(1, largest + 1):
            chain = _mix(chain, before[:, largest - size])
            if size >= self.min_ngram:
                chains.append(chain)
        chains.reverse()  # one column a size, longest first (as ``_sizes``)
        keys = np.stack(chains, axis=1) | 1
        values = followers[:, None] - self._sizes + np.repeat(generations << _OWNER_SHIFT, added)[:, None]
        if int(indexed.min()) < largest:  # some follower lies too near its row's start for an n-gram
            whole = followers[:, None] >= self._sizes
            keys, values = keys[whole], values[whole]
        self._insert(keys.reshape(-1), values.reshape(-1))

    def _empty(self, capacity: int) -> None:
        """Empty the table (at ``capacity`` buckets): every slot is indexed again when next asked about."""
        self.keys = np.zeros(capacity, dtype=np.int64)
        self.values = np.full(capacity, -1, dtype=np.int64)
        self.taken = 0
        self.indexed[:] = 0

    def _insert(self, keys: npt.NDArray[np.int64], values: npt.NDArray[np.int64]) -> None:
        """Enter each key's value (the larger one where the key has an entry, or comes more than once)."""
        table, entries = self.keys, self.values
        mask = table.shape[0] - 1
        buckets = keys & mask
        steps = (keys >> 32) | 1  # double hashing: an odd step visits every bucket of the power-of-two table
        while keys.shape[0]:
            held = table[buckets]
            empty = held == 0
            if empty.any():  # claimed: of several keys claiming one bucket, one is written
                table[buckets[empty]] = keys[empty]
                self.taken += int(np.count_nonzero(empty))
                held = table[buckets]
            mine = held == keys
            np.maximum.at(entries, buckets[mine], values[mine])
            moving = ~mine
            keys, values, steps = keys[moving], values[moving], steps[moving]
            buckets = (buckets[moving] + steps) & mask

    def _find(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Each key's value, -1 where it has no entry."""
        table, entries = self.keys, self.values
        mask = table.shape[0] - 1
        buckets = keys & mask
        held = table[buckets]
        hit = held == keys
        found = np.where(hit, entries[buckets], -1)  # the first probe finds most keys, or an empty bucket
        moving = ~hit & (held != 0)
        if not moving.any():
            return found
        lanes = np.flatnonzero(moving)
        keys = keys[lanes]
        steps = (keys >> 32) | 1
        buckets = (buckets[lanes] + steps) & mask
        while lanes.shape[0]:
            held = table[buckets]
            hit = held == keys
            found[lanes[hit]] = entries[buckets[hit]]
            moving = ~hit & (held != 0)
            lanes, keys, steps = lanes[moving], keys[moving], steps[moving]
            buckets = (buckets[moving] + steps) & mask
        return found


_FULL = 4
"""The table is emptied before more than 1 / _FULL of its buckets would be taken (and made larger when
what the slots index would take more than 1 / (2 _FULL)): short probe sequences."""
_OWNER_SHIFT = 32
"""An entry's value: its start in the low 32 bits, the generation that made it above."""
_START_MASK = (1 << _OWNER_SHIFT) - 1
_SEED_MULTIPLIER = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed 64-bit integer
_MULTIPLIER = -4658895280553007687  # 0xBF58476D1CE4E5B9 as a signed 64-bit integer


def _mix(chain: npt.NDArray[np.int64], ids: npt.NDArray[np.integer]) -> npt.NDArray[np.int64]:
    """The next hash of a chain: the previous one and one more id, mixed (64-bit, wrapping)."""
    mixed = (chain ^ ids) * _MULTIPLIER
    return mixed ^ (mixed >> 31)  # type: ignore[no-any-return]
