"""A schema fuzz run: schemathesis generates requests from the OpenAPI spec the server serves, valid ones and
ones that break it, for every operation; none may get a 5xx, and every error has an OpenAI-style body."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

EXAMPLES_PER_OPERATION_AND_MODE = 20  # the whole run stays well under a minute on two cores


@pytest.fixture(scope="module")
def schema(make_server):
    # Short budgets keep each generated request quick; a request over its time gets a 408, never a 5xx.
    server = make_server(max_model_len=256, default_max_tokens=8, request_timeout=5, max_concurrency=2)
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def operations(schema, mode) -> list:
    """The spec's operations; for invalid input, only those that take any (a parameterless GET has none)."""
    found = [result.ok() for result in schema.get_all_operations()]
    if mode == schemathesis.GenerationMode.NEGATIVE:
        found = [op for op in found if list(op.iter_parameters()) or list(op.body)]
    return found


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda m: m.value)
def test_no_input_gets_a_server_error(schema, mode):
    tested = []
    for operation in operations(schema, mode):

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES_PER_OPERATION_AND_MODE, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def no_server_error(case):
            response = case.call(timeout=30)
            assert response.status_code < 500, f"{case.method} {case.path}: {response.status_code} {response.text}"
            if response.status_code >= 400:
                assert response.json()["error"]["message"], response.text

        no_server_error()
        tested.append(operation.label)
    assert {"POST /v1/chat/completions", "POST /v1/completions", "POST /v1/caches"} <= set(tested)
