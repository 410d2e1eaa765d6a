"""The soak drill (soak.py) in its 2-minute form; `make soak` runs it for 20."""
import json

from tests.engine.entrypoints.openai import soak


def test_two_minute_soak_at_twice_the_sustainable_rate():
    r = soak.run(minutes=2)
    print(json.dumps(r, indent=2))
    assert r["ok"] > 0 and r["preemptions"] > 0  # the drill did load the server and exhaust its KV cache
    assert not soak.verdict(r), soak.verdict(r)
