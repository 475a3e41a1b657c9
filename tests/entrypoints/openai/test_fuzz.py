"""A bounded fuzz pass over the server's own OpenAPI schema (schemathesis strategies driven by hypothesis):
valid and invalid bodies for every route, sent to the real server; none may get a 5xx.

The server is small_server (64-token context, 2 running + 1 queued), so that every accepted request is short.
"""

from __future__ import annotations

import pytest
import schemathesis
from helpers.http_server import API_KEY, wait_idle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

NUM_EXAMPLES = 120


@pytest.mark.slow
def test_no_server_error_over_the_openapi_schema(small_server):
    schema = schemathesis.openapi.from_dict(small_server.app.openapi())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}
    cases = st.one_of([op.as_strategy(generation_mode=mode) for op in operations
                       for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])
    statuses = []

    @settings(max_examples=NUM_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def check(case):
        response = case.call(base_url=small_server.base_url, headers={"authorization": f"Bearer {API_KEY}"},
                             timeout=30)
        statuses.append(response.status_code)
        assert response.status_code < 500, f"{case.method} {case.formatted_path} {case.body!r} -> " \
                                            f"{response.status_code} {response.text[:500]}"

    check()
    assert 200 in statuses and any(400 <= s < 500 for s in statuses)  # both kinds were reached
    with small_server.http() as http:
        wait_idle(http)
