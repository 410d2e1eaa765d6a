"""The engine core's account of its steps by kind (outputs.CoreStats, exported as the server's
cpuserve:engine_step_* counters): what each kind is, and that the real model's steps land in
the kind they are, with their tokens and their time."""
from cpuserve import SamplingParams
from cpuserve.engine.outputs import STEP_KINDS, CoreStats, step_kind


def test_step_kind():
    assert step_kind(0, 16) == "decode"
    assert step_kind(128, 0) == "prefill"
    assert step_kind(128, 15) == "mixed"


def test_count_step_adds_by_kind():
    s = CoreStats()
    s.count_step(0, 16, 16, 0.02)
    s.count_step(0, 16, 16, 0.03)
    s.count_step(256, 10, 266, 0.15)
    assert s.steps == 3 and s.prompt_tokens == 256
    assert s.kind_steps == {"decode": 2, "mixed": 1, "prefill": 0}
    assert s.kind_tokens == {"decode": 32, "mixed": 266, "prefill": 0}
    assert abs(s.kind_seconds["decode"] - 0.05) < 1e-12 and s.kind_seconds["prefill"] == 0


def test_real_steps_are_counted_by_kind(llm_f32):
    engine = llm_f32.engine
    core = engine.core
    before = {k: (core.stats.kind_steps[k], core.stats.kind_tokens[k], core.stats.kind_seconds[k])
              for k in STEP_KINDS}
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", list(range(1000, 1020)), greedy)
    engine.step()  # a's prompt alone: prefill
    engine.add_request("b", list(range(2000, 2030)), greedy)
    engine.step()  # b's prompt and a's next token: mixed
    while engine.has_unfinished_requests():
        engine.step()  # both decoding (a finishes first; b's last steps alone)
    delta = {k: tuple(now - was for now, was in zip(
        (core.stats.kind_steps[k], core.stats.kind_tokens[k], core.stats.kind_seconds[k]), before[k]))
        for k in STEP_KINDS}
    assert delta["prefill"][:2] == (1, 20)
    assert delta["mixed"][:2] == (1, 31)
    # a: 6 tokens = prefill + mixed + 4 decode steps; b: 6 = mixed + 5 decode; 5 decode steps
    assert delta["decode"][:2] == (5, 9)
    assert all(delta[k][2] > 0 for k in STEP_KINDS)


def test_counters_round_trip_through_the_metrics_page():
    from prometheus_client import generate_latest

    from cpuserve.entrypoints.openai.metrics import Metrics, step_totals
    m, s = Metrics("smollm2"), CoreStats()
    assert step_totals(generate_latest(m.registry).decode()) == {
        k: {"steps": 0.0, "seconds": 0.0, "tokens": 0.0} for k in STEP_KINDS}  # every kind from the start
    s.count_step(0, 16, 16, 0.02)
    s.count_step(256, 10, 266, 0.15)
    m.update_stats(s)
    s.count_step(0, 16, 16, 0.03)
    m.update_stats(s)  # snapshots are totals: only what is new is added
    got = step_totals(generate_latest(m.registry).decode())
    assert got["decode"]["steps"] == 2 and got["decode"]["tokens"] == 32
    assert abs(got["decode"]["seconds"] - 0.05) < 1e-9
    assert got["mixed"]["steps"] == 1 and got["mixed"]["tokens"] == 266 and abs(got["mixed"]["seconds"] - 0.15) < 1e-9
    assert got["prefill"]["steps"] == 0


def test_startup_work_gauge_is_1_until_the_core_says_it_is_done():
    from prometheus_client import generate_latest

    from cpuserve.entrypoints.openai.metrics import Metrics, startup_pending
    m, s = Metrics("smollm2"), CoreStats()
    assert startup_pending(generate_latest(m.registry).decode()) is True  # no snapshot yet: not known done
    m.update_stats(s)  # the API process's view before the core's first snapshot: pending
    assert startup_pending(generate_latest(m.registry).decode()) is True
    s.startup_work_pending = False
    m.update_stats(s)
    page = generate_latest(m.registry).decode()
    assert 'cpuserve:startup_work_pending{model_name="smollm2"} 0.0' in page and startup_pending(page) is False
    assert startup_pending("vllm:num_requests_running 0.0\n") is None


def test_the_lora_info_metric_names_the_adapters_in_use_as_vllm_does():
    from prometheus_client import generate_latest

    from cpuserve.entrypoints.openai.metrics import Metrics
    assert "lora_requests_info" not in generate_latest(Metrics("smollm2").registry).decode()  # LoRA off
    m, s = Metrics("smollm2", max_loras=4), CoreStats()
    s.running_loras, s.waiting_loras = ("chat", "sql"), ("sql",)
    m.update_stats(s)
    s.running_loras, s.waiting_loras = ("sql",), ()
    m.update_stats(s)  # one series: the state now, not every state seen
    lines = [x for x in generate_latest(m.registry).decode().splitlines() if x.startswith("vllm:lora_requests_info{")]
    assert len(lines) == 1, lines
    assert 'max_lora="4"' in lines[0] and 'running_lora_adapters="sql"' in lines[0]
    assert 'waiting_lora_adapters=""' in lines[0]
