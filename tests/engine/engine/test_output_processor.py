"""Final-only requests (the offline LLM's) against streamed ones: the same last output, given
once; stop strings still cut them as they are generated."""
import pytest

from cpuserve import SamplingParams
from cpuserve.engine.output_processor import OutputProcessor
from cpuserve.engine.outputs import SeqOutput


@pytest.fixture(scope="module")
def tok():
    from cpuserve.loading.gguf_loader import converted_dir
    from cpuserve.loading.model_loader import default_model_path
    from cpuserve.loading.tokenizer import Tokenizer
    return Tokenizer(converted_dir(default_model_path()))


def _feed(proc, rid, ids, finish, stop_reason=None):
    """The core's outputs for one sequence, a token a step, the last step with its finish."""
    outs, stops = [], []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        got, to_stop = proc.process([SeqOutput(rid, 0, t, None, finish if last else None,
                                               stop_reason if last else None, 3)])
        outs += got
        stops += to_stop
        if to_stop:
            break
    return outs, stops


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_final_only_gives_the_streamed_last_output_once(tok, finish):
    ids = tok.encode("Emoji: 🙂🎉 and CJK: 東京は日本の首都です。 café", add_special_tokens=False) + [2]
    p = SamplingParams(max_tokens=len(ids))
    streamed, final = OutputProcessor(tok), OutputProcessor(tok)
    streamed.add_request("a", None, [1, 2, 3], p)
    final.add_request("a", None, [1, 2, 3], p, final_only=True)
    s_outs, _ = _feed(streamed, "a", ids, finish, 2 if finish == "stop" else None)
    f_outs, _ = _feed(final, "a", ids, finish, 2 if finish == "stop" else None)
    assert len(s_outs) == len(ids) and len(f_outs) == 1 and f_outs[0].finished
    want, got = s_outs[-1].outputs[0], f_outs[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
           (want.text, want.token_ids, want.finish_reason, want.stop_reason)
    assert "🙂" in got.text and not final.requests and not streamed.requests


def test_final_only_with_stop_strings_stops_as_it_goes(tok):
    ids = tok.encode("one two three four five six", add_special_tokens=False)
    p = SamplingParams(max_tokens=50, stop=["four"])
    proc = OutputProcessor(tok)
    proc.add_request("b", None, [1], p, final_only=True)
    outs, stops = _feed(proc, "b", ids, "length")
    assert stops == [("b", 0)]  # the core is told to stop the sequence, mid-stream
    assert len(outs) == 1 and outs[0].outputs[0].text == "one two three " and outs[0].outputs[0].finish_reason == "stop"
