"""The model's generation config as the server's sampling defaults, on the real model: a
request that leaves temperature and max_tokens out gets the config's (greedy, capped), one
that gives its own keeps them, max_new_tokens caps even an explicit max_tokens, and the
Responses API reports what it sampled with."""
import json

import httpx

from tests.engine.entrypoints.openai.conftest import Server

MSGS = [{"role": "user", "content": "Write a long story about a dragon."}]


def test_the_generation_config_fills_what_requests_leave_out(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5,
                                                                 "top_k": 50}))
    s = Server("--generation-config", str(tmp_path), "--override-generation-config", '{"top_p": 0.9}')
    try:
        def chat(**fields):
            r = httpx.post(s.url + "/v1/chat/completions", json={"messages": MSGS, "ignore_eos": True, **fields},
                           timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        left_out = chat()
        assert left_out["usage"]["completion_tokens"] == 5 and left_out["choices"][0]["finish_reason"] == "length"
        capped = chat(max_tokens=50)
        assert capped["usage"]["completion_tokens"] == 5  # max_new_tokens caps every request
        greedy = chat(temperature=0, max_tokens=5)
        assert left_out["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
        hot = {chat(temperature=1.8, top_p=1.0, seed=seed)["choices"][0]["message"]["content"] for seed in (1, 2, 3)}
        assert hot - {greedy["choices"][0]["message"]["content"]}  # the request's own temperature won
        r = httpx.post(s.url + "/v1/responses", json={"input": "Hi"}, timeout=60).json()
        assert (r["temperature"], r["top_p"], r["usage"]["output_tokens"] <= 5) == (0.0, 0.9, True)
    finally:
        log = s.stop()
    assert "default sampling parameters from the model's generation config" in log
    assert "'temperature': 0.0" in log and "'top_k'" not in log  # transformers' top_k 50 says nothing
