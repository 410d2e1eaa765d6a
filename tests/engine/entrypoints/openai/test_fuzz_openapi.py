"""Property-based fuzzing of the served OpenAPI schema: schemathesis turns every
operation of /openapi.json into a hypothesis strategy of requests, valid and
invalid; no generated input may produce a 5xx or take the server down.
Generation lengths are clamped so every example stays short (their validation
is tested in test_errors_and_lifecycle.py)."""
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.engine.entrypoints.openai.conftest import Server

CLAMP = {"max_tokens": 3, "max_completion_tokens": 3, "n": 2, "min_tokens": 3, "top_logprobs": 3, "logprobs": 3}


def _clamp(body, path: str) -> None:
    if isinstance(body, dict):
        if path == "/v1/chat/completions" and "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = CLAMP["max_tokens"]  # absent, it means the rest of the context (~500 tokens)
        for key, cap in CLAMP.items():
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > cap:
                body[key] = cap


@pytest.fixture(scope="module")
def fuzz_server():
    # a short context keeps every generated prompt cheap: long ones get a quick 400
    s = Server("--max-model-len", "512")
    yield s
    s.stop()


def test_no_input_produces_a_server_error(fuzz_server):
    server = fuzz_server
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    failures = []
    # valid inputs everywhere, invalid ones wherever there is an input to break
    cases = [(op, GenerationMode.POSITIVE) for op in operations] + \
        [(op, GenerationMode.NEGATIVE) for op in operations if op.method.upper() == "POST"]
    for op, mode in cases:
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=20, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def run(case):
            _clamp(case.body, op.path)
            response = case.call(base_url=server.url, timeout=120)
            if response.status_code >= 500:
                failures.append(f"{op.method.upper()} {op.path} body={case.body!r} -> {response.status_code}: "
                                f"{response.text[:300]}")
            assert response.status_code < 500, failures[-1]
        run()
    assert httpx.get(server.url + "/health").status_code == 200
