"""`cpuserve run-batch` on the real model: an OpenAI batch file run offline through the server's
app, each line's result in the input's order (the same answers the server gives), and the lines
it cannot run named in their results rather than stopping the batch."""
import json
import subprocess
import sys

from cpuserve import SamplingParams

CHAT = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0}


def test_a_batch_file_runs_offline_in_order(tmp_path, llm_f32):
    lines = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "smollm2", **CHAT}},
        {"custom_id": "done-2", "method": "POST", "url": "/v1/completions",
         "body": {"model": "smollm2", "prompt": "The sky is", "max_tokens": 5, "temperature": 0}},
        {"custom_id": "bad-3", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}},
        {"custom_id": "url-4", "method": "POST", "url": "/v1/files", "body": {}},
        {"custom_id": "other-5", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "gpt-4o", **CHAT}},
        {"custom_id": "chat-6", "method": "POST", "url": "/v1/chat/completions", "body": CHAT},
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines) + "not json\n")
    r = subprocess.run([sys.executable, "-m", "cpuserve", "run-batch", "-i", str(src), "-o", str(out),
                        "--dtype", "float32", "--block-size", "16", "--kv-cache-space", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [g["custom_id"] for g in got] == [x["custom_id"] for x in lines] + [None]
    status = [g["response"]["status_code"] if g["response"] else None for g in got]
    assert status == [200, 200, 400, None, 404, 200, None]
    want = llm_f32.generate("The sky is", SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].text
    assert got[1]["response"]["body"]["choices"][0]["text"] == want
    answer = got[0]["response"]["body"]["choices"][0]["message"]["content"]
    assert answer and answer == got[5]["response"]["body"]["choices"][0]["message"]["content"]
    assert "/v1/files" in got[3]["error"]["message"] and "not JSON" in got[6]["error"]["message"]
    assert "7 requests, 4 failed" in r.stderr
