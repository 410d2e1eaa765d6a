"""Property-based fuzzing of the served OpenAPI schema: schemathesis turns every
operation of /openapi.json into a hypothesis strategy of requests, valid and
invalid, and chains calls along the schema's links (token ids from /tokenize into
/v1/completions, generated text back into /tokenize, ...); no input and no sequence may
produce a 5xx or take the server down. Generation lengths are clamped so every example
stays short (their validation is tested in test_errors_and_lifecycle.py).
`make fuzz` runs the same with CPUSERVE_FUZZ_EXAMPLES=200 (20 here)."""
import collections
import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.engine.entrypoints.openai.conftest import Server

EXAMPLES = int(os.environ.get("CPUSERVE_FUZZ_EXAMPLES", "20"))
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


def fuzz(server, paths: set[str] | None = None) -> None:
    """Every operation (or those of `paths`) with valid inputs, and every POST with invalid ones:
    no 5xx, and the server still healthy."""
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [op for op in (r.ok() for r in schema.get_all_operations()) if paths is None or op.path in paths]
    failures = []
    cases = [(op, GenerationMode.POSITIVE) for op in operations] + \
        [(op, GenerationMode.NEGATIVE) for op in operations if op.method.upper() == "POST" and takes_input(op)]
    for op, mode in cases:
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def run(case):
            _clamp(case.body, op.path)
            response = case.call(base_url=server.url, timeout=120)
            if response.status_code >= 500:
                failures.append(f"{op.method.upper()} {op.path} body={case.body!r} -> {response.status_code}: "
                                f"{response.text[:300]}")
            assert response.status_code < 500, failures[-1]
        run()
    assert httpx.get(server.url + "/health").status_code == 200


def takes_input(op) -> bool:
    """Whether an operation has a body or parameters to make invalid (POST /ping has neither)."""
    return len(op.body) > 0 or bool(list(op.iter_parameters()))


def request_fields(spec: dict, path: str) -> set[str]:
    ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return set(spec["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"])


def test_no_input_produces_a_server_error(fuzz_server):
    spec = httpx.get(fuzz_server.url + "/openapi.json").json()
    assert set(spec["paths"]) >= {"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize",
                                  "/detokenize"}
    structured = {"guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_whitespace_pattern",
                  "structured_outputs", "response_format"}
    assert request_fields(spec, "/v1/completions") >= structured  # what the generated requests exercise
    assert request_fields(spec, "/v1/chat/completions") >= structured | {"tools", "tool_choice",
                                                                          "parallel_tool_calls"}
    assert request_fields(spec, "/v1/embeddings") >= {"input", "encoding_format", "dimensions", "model"}
    assert request_fields(spec, "/v1/rerank") >= {"query", "documents", "top_n"}
    fuzz(fuzz_server)


def test_the_embedding_routes_of_an_embedding_model(fuzz_server):
    """(on the generative server above /v1/embeddings, /v1/score and /v1/rerank only refuse: here they embed)"""
    from cpuserve.loading.model_loader import PACKAGED_EMBEDDER
    s = Server(PACKAGED_EMBEDDER)
    try:
        fuzz(s, {"/v1/embeddings", "/v1/score", "/v1/rerank"})
    finally:
        s.stop()


# the operations the links join (links.py): the scenarios' steps go to them, not to the routes
# outside the chains (/v1/models, /health, ...), which the stateless fuzzing above covers
LINKED = ["tokenize", "detokenize", "completions", "chat_completions", "embeddings"]


def stateful(server, examples: int, steps: int) -> collections.Counter:
    """Scenarios of up to `steps` calls chained along the links; returns how often each
    (operation, status) and each followed link (operation -> operation) occurred."""
    seen: collections.Counter = collections.Counter()
    failures: list[str] = []

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json").include(operation_id=LINKED)

    class Machine(schema.as_state_machine()):
        def setup(self):
            self.last = None

        def before_call(self, case):
            _clamp(case.body, case.path)

        def validate_response(self, response, case, **kwargs):
            seen[(case.path, response.status_code)] += 1
            if self.last is not None:
                seen[(self.last, "->", case.path)] += 1
            self.last = case.path
            if response.status_code >= 500:
                failures.append(f"{case.path} body={case.body!r} -> {response.status_code}: {response.text[:300]}")
            assert response.status_code < 500, failures[-1]

    Machine.run(settings=settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
                                  suppress_health_check=list(HealthCheck)))
    return seen


def test_chained_calls_along_the_links(fuzz_server):
    seen = stateful(fuzz_server, EXAMPLES, 6)
    print(dict(seen))
    followed = {k for k in seen if len(k) == 3}
    assert ("/tokenize", "->", "/detokenize") in followed or ("/tokenize", "->", "/v1/completions") in followed, seen
    assert seen[("/tokenize", 200)] > 0 and httpx.get(fuzz_server.url + "/health").status_code == 200
