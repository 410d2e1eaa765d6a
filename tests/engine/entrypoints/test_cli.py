"""`cpuserve serve`'s own options: refused as argparse refuses its own (usage, the message, exit
status 2) before anything loads, and passed through to the server as given."""
import argparse

import pytest

from cpuserve.config import EngineConfig
from cpuserve.entrypoints import cli, serve
from cpuserve.entrypoints.openai.serving import RequestLog


@pytest.fixture
def served(monkeypatch):
    calls = []
    monkeypatch.setattr(serve, "run", lambda config, options: calls.append((config, options)) or 0)
    return calls


@pytest.mark.parametrize("argv, message", [
    (["--max-request-body-bytes", "0"], "--max-request-body-bytes must be >= 1, got 0"),
    (["--drain-timeout", "-1"], "--drain-timeout must be >= 0 seconds, got -1"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, mistral or pythonic)"),
    (["--chat-template", "no/such/template.jinja"],
     "--chat-template 'no/such/template.jinja' is neither a file nor a Jinja template"),
    (["--allowed-origins", "http://a.example"], "argument --allowed-origins: not a JSON list: 'http://a.example'"),
    (["--allowed-methods", '{"GET": 1}'], "argument --allowed-methods: not a JSON list of strings"),
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-ca-certs", "ca.pem"], "--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and --ssl-certfile"),
    (["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--ssl-cert-reqs", "2"],
     "--ssl-cert-reqs 2 needs --ssl-ca-certs"),
    (["--ssl-keyfile", "no/k.pem", "--ssl-certfile", "no/c.pem"], "--ssl-keyfile no/k.pem: no such file"),
    (["--root-path", "llm/"], "--root-path must start with / and not end with one"),
    (["--enable-log-outputs"], "--enable-log-outputs needs --enable-log-requests"),
    (["--enable-log-requests", "--max-log-len", "-1"], "--max-log-len must be >= 0, got -1"),
    (["--generation-config", "no/such/dir"], "--generation-config no/such/dir: no generation_config.json there"),
    (["--override-generation-config", "temperature=0"], "argument --override-generation-config: not a JSON object"),
    (["--override-generation-config", '{"temperature": "hot"}'],
     "--override-generation-config: temperature must be a number, got 'hot'"),
    (["--override-generation-config", '{"seed": 1}'], "--override-generation-config: seed not among"),
])
def test_bad_serve_options_are_refused_before_anything_loads(served, capsys, argv, message):
    with pytest.raises(SystemExit) as refused:
        cli.main(["serve", *argv])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: cpuserve serve")
    assert f"cpuserve serve: error: {message}" in err
    assert served == []


def test_serve_options_reach_the_server(served):
    assert cli.main(["serve", "--port", "8123", "--drain-timeout", "5", "--max-request-body-bytes", "4096",
                     "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) == 0
    [(config, options)] = served
    assert (options.port, options.drain_timeout, options.max_request_body_bytes) == (8123, 5, 4096)
    assert options.tool_call_parser == "hermes"
    assert config.max_num_batched_tokens == cli.SERVE_BATCHED_TOKENS
    assert options.cors == serve.Cors()  # vLLM's defaults: any origin, method and header, no credentials
    assert cli.main(["serve", "--allowed-origins", '["http://a.example", "http://b.example"]',
                     "--allowed-headers", '["authorization"]', "--allow-credentials"]) == 0
    assert served[-1][1].cors == serve.Cors(("http://a.example", "http://b.example"), ("*",), ("authorization",), True)


def test_chat_template_from_a_file_or_inline(served, tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    inline = "{{ messages[0].content }}"
    assert cli.main(["serve", "--chat-template", str(f)]) == 0
    assert cli.main(["serve", "--chat-template", inline]) == 0
    assert [o.chat_template for _, o in served] == [f.read_text(), inline]


def test_the_stats_line_is_every_vllm_log_stats_interval_unless_disabled(served, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "3")
    assert cli.main(["serve"]) == 0 and cli.main(["serve", "--disable-log-stats"]) == 0
    assert [o.stats_interval for _, o in served] == [3.0, None]
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "soon")
    with pytest.raises(SystemExit):
        cli.main(["serve"])
    assert "VLLM_LOG_STATS_INTERVAL must be a positive number of seconds, got 'soon'" in capsys.readouterr().err
    assert cli.main(["serve", "--disable-log-stats"]) == 0  # not read where nothing is logged


def test_generation_config_options_reach_the_engine(served):
    assert cli.main(["serve", "--generation-config", "vllm", "--override-generation-config", '{"top_k": 5}',
                     "--max-logprobs", "-1"]) == 0
    config = served[0][0]
    assert (config.generation_config, config.override_generation_config) == ("vllm", {"top_k": 5})
    assert config.max_logprobs == -1 and config.resolve_max_logprobs(49152) == 49152


def test_http_options_reach_the_server(served, tmp_path):
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    key.write_text("key")
    cert.write_text("cert")
    assert cli.main(["serve", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--root-path", "/llm",
                     "--disable-fastapi-docs", "--uvicorn-log-level", "info", "--disable-uvicorn-access-log"]) == 0
    options = served[0][1]
    assert options.tls == serve.Tls(str(key), str(cert)) and options.url.startswith("https://")
    assert (options.root_path, options.docs, options.log_level, options.access_log) == ("/llm", False, "info", False)
    assert serve.uvicorn_options(options)["ssl_certfile"] == str(cert)
    assert cli.main(["serve"]) == 0
    assert (served[1][1].tls, served[1][1].docs, served[1][1].access_log) == (None, True, True)
    assert cli.main(["serve", "--enable-prompt-tokens-details", "--enable-force-include-usage",
                     "--return-tokens-as-token-ids"]) == 0
    o = served[2][1]
    assert (o.prompt_tokens_details, o.force_usage, o.tokens_as_ids) == (True, True, True)
    assert served[1][1].log_requests is None  # prompts are users' data: not logged unless asked
    assert cli.main(["serve", "--enable-log-requests", "--enable-log-outputs", "--max-log-len", "100"]) == 0
    assert served[3][1].log_requests == RequestLog(100, True)
    assert cli.main(["serve", "--disable-log-requests"]) == 0 and served[4][1].log_requests is None
    assert cli.main(["serve", "--reasoning-parser", "qwen3"]) == 0 and served[5][1].reasoning_parser == "qwen3"
    assert cli.main(["serve", "--served-model-name", "a", "b", "c"]) == 0
    assert (served[6][0].served_model_name, served[6][1].served_model_name, served[6][1].model_aliases) == \
        ("a", "a", ("b", "c"))
    assert served[5][1].served_model_name is None and served[5][1].model_aliases == ()
    assert not (served[1][1].prompt_tokens_details or served[1][1].force_usage or served[1][1].tokens_as_ids)
    assert "ssl_certfile" not in serve.uvicorn_options(served[1][1])


def test_the_tool_parser_is_off_without_auto_tool_choice(served):
    assert cli.main(["serve", "--tool-call-parser", "hermes"]) == 0
    assert served[0][1].tool_call_parser is None


def test_every_engine_choice_the_cli_offers_is_one_the_config_takes():
    """The CLI's choices and EngineConfig's checks are written apart: `--quantization
    compressed-tensors` was offered, then refused by the config before anything loaded."""
    p = argparse.ArgumentParser()
    cli.add_engine_args(p)
    fields = EngineConfig.__dataclass_fields__
    offered = [(a.dest, c) for a in p._actions if a.choices and a.dest in fields for c in a.choices]
    assert ("quantization", "compressed-tensors") in offered and len(offered) > 15
    for field, choice in offered:
        EngineConfig(**{field: choice})


@pytest.mark.parametrize("argv, message", [
    (["-i", "no/such.jsonl", "-o", "out.jsonl"], "--input no/such.jsonl: no such file"),
    (["-i", __file__, "-o", "out.jsonl", "--max-concurrency", "0"], "--max-concurrency must be >= 1, got 0"),
])
def test_bad_run_batch_options_are_refused_before_anything_loads(capsys, argv, message):
    with pytest.raises(SystemExit) as refused:
        cli.main(["run-batch", *argv])
    assert refused.value.code == 2 and f"cpuserve run-batch: error: {message}" in capsys.readouterr().err
