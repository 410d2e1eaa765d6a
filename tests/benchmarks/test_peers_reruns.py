"""`make bench-peers` with PEERS_ONLY reruns some rows and keeps the others: only on the machine
the kept rows came from."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import peers  # noqa: E402

ZEN3 = {"cpu": "AMD EPYC (family 25, model 1: Zen 3)", "cpus": 2, "isa_flags": ["avx", "avx2", "f16c", "fma"],
        "date": "2026-11-28", "cpu_quota": None}
ZEN4 = {**ZEN3, "cpu": "AMD EPYC (family 25, model 17: Zen 4)",
        "isa_flags": ["avx", "avx2", "avx512_bf16", "avx512f", "f16c", "fma"]}


def test_rows_join_a_table_from_the_same_machine():
    assert peers.rerun_refusal(ZEN3, {**ZEN3, "date": "2026-11-29", "cpu_quota": 2.0}) is None


def test_rows_from_another_machine_are_refused_with_both_names():
    why = peers.rerun_refusal(ZEN3, ZEN4)
    assert "Zen 3" in why and "Zen 4" in why and "cpu, isa_flags differ" in why
    assert "run the full `make bench-peers`" in why
    assert "cpus differ" in peers.rerun_refusal(ZEN3, {**ZEN3, "cpus": 4})


def test_no_stored_run_is_refused():
    assert "run the full `make bench-peers` first" in peers.rerun_refusal(None, ZEN3)


def test_alternating_rounds_are_shown_run_by_run():
    alt = {"cpuserve float32": {"batch1_ms": [10.0, 16.0], "read_gbs": [34.0, 52.0],
                                "rounds": [[16.0, 52.0], [10.0, 34.0], [17.0, 55.0]]},
           "llama.cpp F32": {"batch1_ms": [13.0, 16.0], "read_gbs": [33.0, 34.0]}}
    lines = peers.alternating_table(alt)
    ours = next(line for line in lines if line.startswith("| cpuserve float32 |"))
    assert ours.endswith("| 16.00 (52), 10.00 (34), 17.00 (55) |")
    # a stored run from before rounds were kept still reads
    assert next(line for line in lines if line.startswith("| llama.cpp F32 |")).endswith("|  | – |")


def test_a_failed_run_is_one_cell_that_says_how_it_ended():
    died = ("CalledProcessError: Command '['/cache/llama.cpp/bin/llama-batched-bench', '-m', 'x.gguf', '-t', '2']' "
            "died with <Signals.SIGILL: 4>.")
    assert peers.failure(died) == "llama-batched-bench died with <Signals.SIGILL: 4>."
    exited = "RuntimeError: llama server exited:\n0.00.003 I srv  llama_server: initializing | ...\nmore"
    assert peers.failure(exited) == "RuntimeError: llama server exited:"
    row = peers.offline_rows({"llama.cpp Q4_1": {"error": died}})[0]
    assert "\n" not in row and row.count("|") == 8


def test_w8a8_rows_pair_with_each_other_and_read_the_int8_weights():
    roof = {"engines": {"float32": {"weight_bytes": 9}, "bfloat16": {"weight_bytes": 7}, "w8a8": {"weight_bytes": 5}}}
    assert peers.counterpart("vLLM W8A8") == "cpuserve W8A8"
    assert [peers.weight_bytes(n, roof) for n in ("vLLM W8A8", "cpuserve W8A8", "cpuserve bfloat16", "vLLM float32")] \
        == [5, 5, 7, 9]
    off = {"cpuserve W8A8": {"offline_tok_s": [1400.0, 1450.0], "batch1_ms": [4.5, 4.6], "prefill_2048_s": [0.56, 0.57]},
           "vLLM W8A8": {"offline_tok_s": [800.0, 815.0], "batch1_ms": [11.3, 12.3], "prefill_2048_s": [0.86, 0.95]}}
    row = next(line for line in peers.offline_rows(off) if line.startswith("| vLLM W8A8 |"))
    assert row.endswith("| **1.78x** / **2.67x** / **1.67x** |"), row


def test_engines_on_the_same_weights_take_turns_run_by_run(monkeypatch):
    order, probes = [], iter(range(100))
    monkeypatch.setattr(peers, "read_gbs", lambda: 30.0 + next(probes))
    tok = {"ours": iter([300.0, 340.0, 320.0]), "theirs": iter([200.0, 250.0, 240.0])}

    def engine(name):
        def fn():
            order.append(name)
            return {"offline_tok_s": next(tok[name]), "note": "text"}
        return fn
    both = peers.taking_turns({"cpuserve float32": engine("ours"), "vLLM float32": engine("theirs")}, n=3)
    assert order == ["ours", "theirs"] * 3
    assert both["cpuserve float32"]["offline_tok_s"] == [300.0, 320.0]
    assert both["vLLM float32"]["offline_tok_s"] == [200.0, 240.0]
    # each run's bandwidth: the better of the probes just before and after it, one probe between two runs
    assert [r["read_gbs"] for r in both["cpuserve float32"]["rounds"]] == [31.0, 33.0, 35.0]
    assert [r["read_gbs"] for r in both["vLLM float32"]["rounds"]] == [32.0, 34.0, 36.0]
    assert "note" not in both["vLLM float32"] and "note" not in both["vLLM float32"]["rounds"][0]
    table = peers.turns_table(both)
    row = next(line for line in table if line.startswith("| cpuserve float32 / vLLM float32 |"))
    assert "300.0 / 200.0 (1.50x), 340.0 / 250.0 (1.36x), 320.0 / 240.0 (1.33x)" in row
    assert row.endswith("| 1.33x / 1.36x |")
    # rows run one engine after the other (a stored run from before turns) have no rounds table
    assert peers.turns_table({k: {**v, "rounds": []} for k, v in both.items()}) == []


def test_served_levels_take_turns_level_by_level_with_every_server_up(monkeypatch):
    events, clock = [], iter(float(x) for x in range(100))

    class FakeServed:
        def __init__(self, engine, dtype, hf_dir, gguf):
            events.append(("up", engine))
            self.proc = type("P", (), {"pid": len(events)})()

        def level(self, c, prompts):
            events.append(("level", self.proc.pid, c))
            return {"concurrency": c, "wall_s": 10.0, "tok_s": 100.0}

        def result(self, levels):
            return {"levels": levels}
    monkeypatch.setattr(peers, "Served", FakeServed)
    monkeypatch.setattr(peers, "stop", lambda proc: events.append(("stop", proc.pid)))
    monkeypatch.setattr(peers, "tree_cpu_seconds", lambda pid: next(clock))
    monkeypatch.setattr(peers, "LEVELS", [1, 16])
    both = peers.serve_in_turns({"cpuserve float32": ("cpuserve", "float32"), "vLLM float32": ("vllm", "float32")},
                                None, None)
    assert events == [("up", "cpuserve"), ("up", "vllm"), ("level", 1, 1), ("level", 2, 1), ("level", 1, 16),
                      ("level", 2, 16), ("stop", 1), ("stop", 2)]
    # the idle server's CPU read before and after each level (the fake clock adds 1 s between)
    assert [lv["idle_cpu_s"] for lv in both["cpuserve float32"]["levels"]] == [1.0, 1.0]
    note = peers.served_turns_note(both)
    assert note[1].startswith("cpuserve float32 and vLLM float32 took turns level by level")
    assert "at most 10.0% of a CPU meanwhile (1.00 s of CPU in the 10.0 s" in note[1]
    # rows served one engine at a time have no note
    assert peers.served_turns_note({"llama.cpp Q4_1": {"levels": [{"concurrency": 1, "wall_s": 9.0}]}}) == []


def test_a_servers_cpu_counts_the_processes_below_it():
    import os
    import subprocess
    import sys
    burn = "import time\nwhile time.process_time() < 0.4: pass\nprint('done', flush=True)\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"  # its CPU time no longer grows (it sleeps)
        cpu = peers.serving.cpu_seconds
        own, childs = cpu(os.getpid()), cpu(child.pid)
        tree = peers.tree_cpu_seconds(os.getpid())
        assert childs >= 0.35  # (the kernel counts in 10 ms ticks)
        assert tree >= own + childs and peers.tree_cpu_seconds(child.pid) == childs
    finally:
        child.kill()
        child.wait()


def test_one_engine_repeated_keeps_min_and_median_without_rounds(monkeypatch):
    probes, runs = iter(range(100)), iter([5.0, 3.0, 4.0])
    monkeypatch.setattr(peers, "read_gbs", lambda: 30.0 + next(probes))
    r = peers.repeated(lambda: {"batch1_ms": next(runs)}, n=3)
    assert r == {"batch1_ms": [3.0, 4.0], "read_gbs": [31.0, 32.0]}


def test_prefills_take_turns_prompt_by_prompt_the_order_flipping_each_round(monkeypatch):
    events, clock, times = [], iter(float(x) for x in range(100)), iter([2.6, 3.0, 2.8, 2.5, 2.7, 3.2])

    class FakeWorker:
        def __init__(self, engine, dtype, model):
            events.append(("up", engine, dtype))
            self.pid = len(events)

        def prefill(self):
            events.append(("prefill", self.pid))
            return next(times)

        def close(self):
            events.append(("close", self.pid))
    monkeypatch.setattr(peers, "PrefillWorker", FakeWorker)
    monkeypatch.setattr(peers, "tree_cpu_seconds", lambda pid: next(clock))
    both = peers.prefill_in_turns({"cpuserve float32": ("cpuserve", "float32", "m"),
                                   "vLLM float32": ("vllm", "float32", "hf")}, rounds=3)
    assert events == [("up", "cpuserve", "float32"), ("up", "vllm", "float32"), ("prefill", 1), ("prefill", 2),
                      ("prefill", 2), ("prefill", 1), ("prefill", 1), ("prefill", 2), ("close", 1), ("close", 2)]
    ours, theirs = both["cpuserve float32"], both["vLLM float32"]
    assert [r[0] for r in ours["rounds"]] == [2.6, 2.5, 2.7] and [r[0] for r in theirs["rounds"]] == [3.0, 2.8, 3.2]
    assert ours["prefill_2048_s"] == [2.5, 2.6] and theirs["prefill_2048_s"] == [2.8, 3.0]
    assert ours["idle_cpu_s"] == 1.0  # the idle engine's CPU read before and after each prefill
    row = peers.prefill_turns_table({"float32": both})[-1]
    assert row.startswith("| float32 | 2.50 / 2.60 | 2.80 / 3.00 | **1.15x** / **1.15x** | 3 of 3 |"), row
    assert row.endswith("| 2.60 / 3.00, 2.50 / 2.80, 2.70 / 3.20 | 1.00 |")
    failed = peers.prefill_turns_table({"W8A8": {"error": "RuntimeError: vllm w8a8 prefill worker ended (1)"}})[-1]
    assert failed.startswith("| W8A8 | failed: RuntimeError: vllm w8a8 prefill worker ended (1) |")
    assert peers.prefill_turns_table(None) == []


def test_a_prefill_worker_answers_each_line_with_a_new_long_prompts_time(monkeypatch, capsys):
    import io
    import peer_offline
    seen = []

    class Engine:
        def generate(self, batch, tokens):
            seen.append((tuple(batch[0]), tokens))
    monkeypatch.setattr(sys, "stdin", io.StringIO("go\ngo\n"))
    peer_offline.prefill_turns(Engine())
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "READY" and [line.split()[0] for line in out[1:]] == ["PREFILL", "PREFILL"]
    assert all(float(line.split()[1]) >= 0 for line in out[1:])
    assert len(seen) == 3 and len({p for p, _ in seen}) == 3  # a warm-up, then a new prompt each time
    assert all(len(p) == peer_offline.LONG and tokens == 1 for p, tokens in seen)
