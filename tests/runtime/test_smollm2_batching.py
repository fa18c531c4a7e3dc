"""64 concurrent greedy requests on the real SmolLM2 core produce exactly the tokens they produce alone."""

from __future__ import annotations

import pytest

from helios_core.runtime.messages import Finished, PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.startup import RunningModel

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0)
TOPICS = ["France", "Japan", "Brazil", "Kenya", "Canada", "Norway", "Egypt", "India"]


def test_sixty_four_concurrent_requests_match_their_solo_runs(smol_running: RunningModel) -> None:
    engine = smol_running.engine
    prompts = [
        smol_running.bootstrap.encode_prompt([{"role": "user", "content": f"Name the capital of {topic}."}])
        for topic in TOPICS
    ]
    solo = {
        i: engine.generate(PreparedRequest(f"solo{i}", prompt, 6, GREEDY, ignore_eos=True)).token_ids
        for i, prompt in enumerate(prompts)
    }
    streams = [
        engine.submit(PreparedRequest(f"r{n}", prompts[n % len(prompts)], 6, GREEDY, ignore_eos=True))
        for n in range(64)
    ]
    for n, stream in enumerate(streams):
        events = list(stream)
        assert isinstance(events[-1], Finished)
        assert [e.token_id for e in events if isinstance(e, TokenEvent)] == solo[n % len(prompts)], n
    stats = engine.statistics()
    assert stats.launches.get("decode_b8", 0) > 0
    assert stats.reused_tokens > 0  # the shared chat-template prefix was reused
    engine.allocator.check()
    assert engine.allocator.referenced_pages == 0
