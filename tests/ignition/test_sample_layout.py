"""How ``sample``'s chunked launches share a row's vocabulary out over programs."""

from __future__ import annotations

import pytest
from ignition.kernels.sampling import CHUNK, PROGRAMS_PER_MULTIPROCESSOR, SampleLayout, choose_sample_layout


@pytest.mark.parametrize(
    ("rows", "vocab", "programs"),
    [
        (1, 128256, 63),  # few rows: every chunk its own program
        (8, 128256, 63),
        (16, 128256, 63),
        (17, 128256, 63),  # 1056 / 17 = 62.1 programs a row still cover the 63 chunks
        (64, 128256, 17),  # 1088 programs, about eight on each of 132 multiprocessors
        (256, 128256, 5),
        (256, 49152, 5),
        (64, 49152, 17),
        (1024, 128256, 2),
    ],
)
def test_rows_share_their_chunks_out_over_about_eight_programs_a_multiprocessor(
    rows: int, vocab: int, programs: int
) -> None:
    layout = choose_sample_layout(rows, vocab)
    assert layout == SampleLayout(chunk=CHUNK, programs=programs, warps=4)
    chunks = -(-vocab // CHUNK)
    launched = rows * layout.programs
    assert layout.programs == chunks or launched >= PROGRAMS_PER_MULTIPROCESSOR * 132


def test_a_small_vocabulary_is_one_chunk_of_its_power_of_two() -> None:
    assert choose_sample_layout(4, 1000) == SampleLayout(chunk=1024, programs=1, warps=4)
    assert choose_sample_layout(300, 2048) == SampleLayout(chunk=2048, programs=1, warps=4)


def test_fewer_multiprocessors_give_fewer_programs() -> None:
    assert choose_sample_layout(256, 128256, multiprocessors=66).programs == 3
    assert choose_sample_layout(256, 128256, multiprocessors=132).programs == 5
