"""Errors in OpenAI's shape with the right status, never a 500; overload;
cancellation on disconnect; a burst of concurrent streams; engine-core death."""
import asyncio
import json
import os
import re
import signal
import time

import httpx
import psutil
import pytest

from cpuserve import SamplingParams
from tests.engine.entrypoints.openai.conftest import Server


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"),
    ({"prompt": "x", "min_tokens": 9, "max_tokens": 2}, None),
    ({"prompt": "x", "stop": [""]}, None),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, None),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": [10 ** 9]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
])
def test_invalid_completion_requests_are_400(server, body, param):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if param:
        assert param in (err["param"] or "") or param in err["message"]


def test_any_origin_may_call_by_default_as_in_vllm(server):
    r = httpx.get(server.url + "/v1/models", headers={"Origin": "http://page.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_invalid_chat_requests_are_400(server):
    assert post(server, "/v1/chat/completions", {"messages": []}).status_code == 400
    assert post(server, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}).status_code == 400
    assert post(server, "/v1/chat/completions", {"messages": "hello"}).status_code == 400
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]  # the JSON decoder's reason and where, not a field named "1"
    assert err["param"] is None and err["message"].startswith("the request body is not valid JSON: Expecting"), err


def test_prompt_longer_than_context_is_400(server):
    r = post(server, "/v1/completions", {"prompt": "hello " * 9000, "max_tokens": 4})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {"prompt": "hello " * 9000, "max_tokens": 4, "stream": True})
    assert r.status_code == 400


def test_hostile_bodies_are_400(server):
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b', "max_tokens": 1}'  # 100,000-deep nesting
    r = httpx.post(server.url + "/v1/completions", content=deep, timeout=60, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]
    parts = [{"type": "text", "text": "hi "} for _ in range(10_000)]  # one message of 10,000 content parts
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}], "max_tokens": 1})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_unknown_model_is_404(server):
    r = post(server, "/v1/completions", {"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404 and "gpt-9" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/no/such/route").status_code == 404


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_disconnect_cancels_and_frees_blocks(server, stream):
    body = {"prompt": "Count forever:", "max_tokens": 2000, "ignore_eos": True, "stream": stream}
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 6:
                    break  # leaving the block closes the connection
    else:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            httpx.post(server.url + "/v1/completions", json=body, timeout=2)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = httpx.get(server.url + "/metrics").text
        running = [ln for ln in m.splitlines() if ln.startswith("vllm:num_requests_running")]
        usage = [ln for ln in m.splitlines() if ln.startswith("vllm:kv_cache_usage_perc")]
        if float(running[0].split()[-1]) == 0 and float(usage[0].split()[-1]) == 0:
            return
        post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1})  # the core reports stats per step
        time.sleep(0.3)
    pytest.fail("the abandoned request kept running or kept its KV blocks")


def test_burst_of_64_streams_matches_offline(server, llm_f32):
    prompts = [f"Fact {i}: the number {i * 7} is" for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=12)
    want = [o.outputs[0].text for o in llm_f32.generate(prompts, params)]

    async def one(client, p):
        text = ""
        async with client.stream("POST", server.url + "/v1/completions",
                                 json={"prompt": p, "max_tokens": 12, "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def burst():
        async with httpx.AsyncClient(timeout=300) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    assert asyncio.run(burst()) == want


def test_api_key_overload_and_body_limit():
    s = Server("--api-key", "sekret", "--max-waiting-requests", "1", "--max-request-body-bytes", "100000",
               "--allowed-origins", '["http://ui.example"]')
    try:
        auth = {"Authorization": "Bearer sekret"}
        big = {"prompt": "word " * 30000, "max_tokens": 1}  # ~150 kB
        for content in (json.dumps(big).encode(),                            # with a content-length
                        (json.dumps(big).encode()[i:i + 8192] for i in range(0, 150_100, 8192))):  # chunked
            r = httpx.post(s.url + "/v1/completions", content=content, timeout=60,
                           headers={**auth, "content-type": "application/json"})
            assert r.status_code == 413 and "100000 bytes" in r.json()["error"]["message"], r.text
        assert httpx.post(s.url + "/v1/completions", json=big, timeout=60).status_code == 413  # before the key check
        marker = "PROMPT-MARKER-7d1c"  # neither prompt text nor the key reaches the logs at the default level
        assert httpx.post(s.url + "/v1/completions", json={"prompt": marker, "max_tokens": 2}, headers=auth,
                          timeout=60).status_code == 200
        assert marker not in s.output() and "sekret" not in s.output()
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        ok = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                        headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200  # not behind the key
        assert httpx.get(s.url + "/metrics").status_code == 200
        # every other route is (vLLM asks for it on /v1 alone)
        assert httpx.post(s.url + "/tokenize", json={"prompt": "x"}).status_code == 401
        assert httpx.post(s.url + "/tokenize", json={"prompt": "x"}, headers=auth).status_code == 200
        assert httpx.post(s.url + "/v2/rerank", json={"query": "x", "documents": ["y"]}).status_code == 401
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        ok = httpx.options(s.url + "/v1/completions", headers={"Origin": "http://ui.example", **preflight})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://ui.example"
        bad = httpx.options(s.url + "/v1/completions", headers={"Origin": "http://other.example", **preflight})
        assert "access-control-allow-origin" not in bad.headers  # the browser then refuses the call
        denied = httpx.post(s.url + "/v1/completions", json={"prompt": "x"}, headers={"Origin": "http://ui.example"})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "http://ui.example"
        assert httpx.get(s.url + "/ping").status_code == httpx.post(s.url + "/ping").status_code == 200

        async def flood():
            async with httpx.AsyncClient(timeout=120, headers={"Authorization": "Bearer sekret"}) as c:
                return await asyncio.gather(*(c.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 8})
                                              for _ in range(16)))
        codes = [r.status_code for r in asyncio.run(flood())]
        assert set(codes) <= {200, 503} and 503 in codes and 200 in codes
    finally:
        s.stop()


def test_chat_template_given_at_start_renders_every_conversation(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")
    s = Server("--chat-template", str(f))
    try:
        msgs = [{"role": "user", "content": "Hi there"}]
        got = httpx.post(s.url + "/tokenize", json={"messages": msgs}).json()["tokens"]
        want = httpx.post(s.url + "/tokenize", json={"prompt": "[user] Hi there\n[assistant] ",
                                                     "add_special_tokens": False}).json()["tokens"]
        assert got == want
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}, timeout=60).json()
        assert r["usage"]["prompt_tokens"] == len(want)
    finally:
        s.stop()


def test_engine_core_death_fails_requests_and_exits_nonzero():
    s = Server()
    try:
        core = [p for p in psutil.Process(s.proc.pid).children(recursive=True)
                if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())]
        assert len(core) == 1

        async def stream_then_kill():
            async with httpx.AsyncClient(timeout=60) as c:
                async with c.stream("POST", s.url + "/v1/completions",
                                    json={"prompt": "Go on:", "max_tokens": 3000, "ignore_eos": True,
                                          "stream": True}) as r:
                    lines = []
                    async for line in r.aiter_lines():
                        lines.append(line)
                        if len(lines) == 4:
                            core[0].send_signal(signal.SIGKILL)
                    return lines

        try:
            lines = asyncio.run(stream_then_kill())
            assert any('"error"' in ln for ln in lines) or lines[-1] != "data: [DONE]"
        except httpx.HTTPError:
            pass  # the connection ended: also an end, not a hang
        assert s.proc.wait(30) != 0
    finally:
        s.stop()


def test_503_while_loading_then_ready():
    """The port opens before the model is loaded; until then every route answers 503."""
    import subprocess
    import sys
    import tempfile

    from tests.engine.entrypoints.openai.conftest import free_port
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "cpuserve", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--dtype", "float32", "--kv-cache-space", "0.5"], stdout=log, stderr=subprocess.STDOUT)
    seen = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                r = httpx.get(url + "/health", timeout=1)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            seen.append(r.status_code)
            if r.status_code == 503:
                busy = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
                if busy.status_code == 503:
                    assert "loading" in busy.json()["error"]["message"]
                else:  # loading finished between the two requests
                    assert busy.status_code == 200 and httpx.get(url + "/health").status_code == 200
            if r.status_code == 200:
                break
            time.sleep(0.05)
        assert seen and seen[0] == 503 and seen[-1] == 200, seen
    finally:
        proc.terminate()
        proc.wait(20)


def test_sigterm_to_the_process_group_drains():
    """Kubernetes' stop: SIGTERM (here to the whole process group, engine core included).
    The stream in flight finishes with its finish reason and [DONE]; new requests and
    /health get 503 meanwhile; the server exits 0 and leaves no process behind."""
    s = Server("--drain-timeout", "60", new_session=True)
    try:
        procs = [psutil.Process(s.proc.pid), *psutil.Process(s.proc.pid).children(recursive=True)]
        body = {"prompt": "Count:", "max_tokens": 120, "ignore_eos": True, "stream": True}
        chunks = []
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                if len(chunks) == 3:
                    break
            os.killpg(s.proc.pid, signal.SIGTERM)
            time.sleep(0.3)
            assert post(s, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 503
            assert httpx.get(s.url + "/health").status_code == 503
            rest = list(lines)
        chunks += [json.loads(ln[6:]) for ln in rest if ln.startswith("data: {")]
        assert rest[-1] == "data: [DONE]" or rest[-2:] == ["data: [DONE]", ""]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert s.proc.wait(30) == 0, s.output()[-3000:]
        # the engine core is stopped by the API process; multiprocessing's resource tracker
        # leaves when its pipe closes, a moment after the API process
        _, alive = psutil.wait_procs(procs[1:], timeout=15)
        assert not [(p.pid, p.name()) for p in alive]
    finally:
        s.stop()


MALFORMED = [b"{", b'{"prompt": "x",}', b"[1, 2", b"nul", b'{"prompt": "\xff\xfe caf\xe9"}', b"\x00\x01\x02",
             b'{"prompt": "x"} trailing']


@pytest.mark.parametrize("body", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_json_and_invalid_utf8_are_400(server, body):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        r = httpx.post(server.url + path, content=body, timeout=60, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("field,value,named", [
    ("stop", [f"s{i}" for i in range(65)], "at most 64 strings"),
    ("stop", ["x" * 1025], "at most 1024 characters"),
    ("stop_token_ids", list(range(1025)), "at most 1024 ids"),
    ("logit_bias", {str(i): 1 for i in range(1025)}, "at most 1024 tokens"),
    ("n", 129, "n"),
])
def test_oversized_requests_name_the_limit(server, field, value, named):
    for path, base in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = post(server, path, {**base, field: value})
        assert r.status_code == 400 and named in r.json()["error"]["message"], (path, r.text[:300])


ADVERSARIAL = ["\u202eevil\u202c", "a\u200d\u200db", "e\u0301\u0301\u0301", "\ufeff\ufffd", "🏳️‍🌈" * 50,
               "\ud800 lone surrogate", "\x00nul", "𝕏" * 300]


@pytest.mark.parametrize("text", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_adversarial_unicode_in_prompts_and_stop_strings(server, text):
    body = json.dumps({"prompt": text, "max_tokens": 3, "stop": [text[:8] or "x"]}).encode()  # \ud800 stays escaped
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/completions", timeout=60, headers={"content-type": "application/json"},
                       content=body.replace(b'"max_tokens"', b'"stream": %s, "max_tokens"' % json.dumps(stream).encode()))
        assert r.status_code in (200, 400), r.text[:300]
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 3, "stop": text[:8] or "x"}
    r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps(chat).encode(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code in (200, 400), r.text[:300]
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_slow_stream_reader_gets_every_token(server):
    """A client that reads its stream slowly. Once the socket buffers are full the
    server's writes wait, and the engine's outputs for the request coalesce (one
    unread snapshot per request, tests/engine/engine/test_mailbox.py); whatever the
    chunking, the text and the token count are exactly those of a fast reader."""
    body = {"prompt": "Once upon a time", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    want = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True,
                      "stream_options": {"include_usage": True}}, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            if obj["choices"]:
                text += obj["choices"][0]["text"]
                time.sleep(0.2)  # far slower than the engine's steps
            else:
                usage = obj["usage"]
    assert text == want and usage["completion_tokens"] == 60


def test_sigkill_of_the_api_process_takes_the_engine_core_down():
    """The API process killed outright (OOM killer, SIGKILL): the engine core and
    multiprocessing's helper notice their parent is gone and exit within seconds."""
    s = Server(new_session=True)
    try:
        children = psutil.Process(s.proc.pid).children(recursive=True)
        assert any("spawn_main" in " ".join(c.cmdline()) for c in children)
        s.proc.kill()
        _, alive = psutil.wait_procs(children, timeout=20)
        assert not [(p.pid, p.name()) for p in alive]
    finally:
        s.stop()


def test_kv_cache_is_populated_and_weights_get_huge_pages_while_idle_and_answers_do_not_change():
    """The server is ready with the KV cache's first 256 MiB populated and the weights on 4 KiB
    pages; while no request runs the weights are turned into huge pages (MADV_COLLAPSE, Linux
    6.1+; before, advised for khugepaged), the rest of the cache (here 768 MiB) is populated,
    and committed: the engine core's resident memory ends above the weights (~620 MiB as
    float32) plus the whole 1 GiB cache; then the cache is turned into huge pages too. /metrics
    says when all that is done (cpuserve:startup_work_pending 1, then 0)."""
    from cpuserve.entrypoints.openai.metrics import startup_pending

    s = Server()
    try:
        body = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
        first = post(s, "/v1/completions", body).json()["choices"][0]["text"]
        assert startup_pending(httpx.get(s.url + "/metrics").text) is True
        deadline = time.monotonic() + 120
        done = ("KV cache: 1024 MiB on huge pages", "KV cache: MADV_COLLAPSE stopped")
        while not any(line in s.output() for line in done) and time.monotonic() < deadline:
            time.sleep(0.5)
        out = s.output()
        assert "KV cache of 1.00 GiB: 256 MiB populated in" in out and "every block populated" in out, out
        core = [p for p in psutil.Process(s.proc.pid).children(recursive=True)
                if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())]
        assert core[0].memory_info().rss > (1024 + 600) * 2**20
        if "MADV_COLLAPSE stopped" not in out:
            collapsed = re.search(r"weights: (\d+) MiB on huge pages", out)
            assert collapsed and int(collapsed[1]) >= 90, out  # the Q4_1 file's 94 MiB, as stored
            assert done[0] in out, out
            with open(f"/proc/{core[0].pid}/smaps_rollup") as f:
                huge = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
            assert huge >= (int(collapsed[1]) - 2 + 1024) * 1024  # kB
        while startup_pending(httpx.get(s.url + "/metrics").text) and time.monotonic() < deadline:
            time.sleep(0.2)  # (the core's snapshot follows its log line)
        assert startup_pending(httpx.get(s.url + "/metrics").text) is False
        assert post(s, "/v1/completions", body).json()["choices"][0]["text"] == first
    finally:
        s.stop()
