"""What startup builds is kept out of the cyclic collector's passes while the model serves, and given back
when it closes."""

from __future__ import annotations

import gc

from helios_core.contract import LoadOptions
from helios_core.runtime.messages import PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.startup import start

from .conftest import FIXTURES, fixture_settings


def test_startup_freezes_what_it_built_and_close_gives_it_back() -> None:
    gc.unfreeze()
    running = start(FIXTURES / "payload-v3.core", fixture_settings(), LoadOptions(), backend="reference")
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        # the model's own objects are among the frozen ones: a full pass no longer reports them as tracked
        tracked = {id(o) for o in gc.get_objects()}
        assert id(running.model) not in tracked and id(running.engine) not in tracked
        stream = running.engine.submit(PreparedRequest("r", [1, 2, 3], 4, SamplingParams(temperature=0.0)))
        assert sum(isinstance(event, TokenEvent) for event in stream) == 4  # serving works frozen
    finally:
        running.close()
    assert gc.get_freeze_count() == 0
