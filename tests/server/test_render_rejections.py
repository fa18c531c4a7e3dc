"""The render endpoints count their admission rejections as the generating endpoints do.

``helios_requests_rejected_total`` counts every admission rejection a client sees (docs/metrics.md):
the permanent 503 ``admission_rejected`` of a prompt outside the capacities and the 429 of a full
ingress. The render endpoints run the same admission and preparation, so a render refused in
preparation counts once too, while the worker's received count does not move (nothing reached it).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.conftest import Served
from tests.server.helpers import metric_values

OVERSIZE = "z" * (2 << 20)
"""Message text that cannot fit the fixture core's 64-token context whatever it encodes to."""


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": OVERSIZE}]}),
        ("/v1/completions/render", {"prompt": OVERSIZE}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": OVERSIZE}]}),
        ("/v1/completions", {"prompt": OVERSIZE}),
    ],
)
def test_a_permanent_503_counts_once_as_rejected_on_every_endpoint(
    served: Served, path: str, body: dict[str, Any]
) -> None:
    before = metric_values(served.base_url)
    response = httpx.post(served.base_url + path, json={**body, "max_tokens": 2}, timeout=30)
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("admission_rejected", 503)
    assert response.headers["x-should-retry"] == "false"
    after = metric_values(served.base_url)
    assert after["helios_requests_rejected_total"] == before["helios_requests_rejected_total"] + 1
    assert after["helios_requests_received_total"] == before["helios_requests_received_total"]
