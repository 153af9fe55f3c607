"""Schemathesis against the live server's own OpenAPI document: generated requests, valid bodies
and invalid ones, for every operation. None may get a 5xx or hang; the document states the limits
the server enforces, so the valid ones stay within them (and take at most seconds on a CPU)."""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from servers import running_server

EXAMPLES = int(os.environ.get("LLMSERVE_FUZZ_EXAMPLES", 100))
"""Per operation and mode: ~1,400 requests in CI; raise it for a longer hunt."""


@pytest.fixture(scope="module")
def fuzzed():
    with running_server(engine_process=True, model_opts={"max_model_len": 64}, max_choices=4) as s:
        yield s


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_gets_a_server_error_or_hangs(fuzzed, mode):
    schema = schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions",
                                               "POST /tokenize", "POST /detokenize"}
    if mode is GenerationMode.NEGATIVE:  # only a body can be invalid: the GET operations take no input
        operations = [op for op in operations if op.label.startswith("POST")]
    calls: list[str] = []
    for op in operations:
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def check(case):
            response = case.call(base_url=fuzzed.url, timeout=30)
            calls.append(op.label)
            assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:500])
            assert response.elapsed < 10, case.as_curl_command()
        check()
    assert len(calls) >= 2 * len(operations)
    assert fuzzed.client().completions.create(model="llmserve-builtin", prompt="x", max_tokens=1).choices
