"""The incremental detokenizer gives, token after token, what a whole decode of the outputs
gives (the rule it replaces): on the default model's tokenizer, on Llama-2-style
SentencePiece decoding (leading-space strip, byte fallback), on WordPiece and on a
tokenizer that cleans up spaces; stop strings cut the same text."""
import json
import random

import pytest

from cpuserve.engine.detokenizer import Detokenizer
from cpuserve.loading.tokenizer import Tokenizer

TEXTS = [
    "The capital of France is Paris. It isn't small, and it's old!",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f(3))",
    "Emoji: 🙂🎉 and CJK: 東京は日本の首都です。 Accents: café, naïve, Ærø.",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello , world ' s end .",
]


@pytest.fixture(scope="module")
def smollm2():
    from cpuserve.loading.gguf_loader import converted_dir
    from cpuserve.loading.model_loader import default_model_path
    return Tokenizer(converted_dir(default_model_path()))


def whole(tok, ids, skip):
    """The rule before: a whole decode, kept while it does not end in an incomplete character."""
    text = tok.decode(ids, skip_special_tokens=skip)
    return None if text.endswith("\ufffd") else text


def stream_matches_whole(tok, ids, skip=True, exact_on_junk=True):
    """Token by token: the text only grows, and it is the whole decode's. With byte-fallback
    tokens, where an invalid byte turns the bytes before it in its group (already sent) into
    U+FFFD, the whole decode changes text already out: exactness and growth are then asked
    only of text without U+FFFD. Cleaning up spaces changes text already out too ("It is n"
    -> "It isn't"), and the text follows."""
    det, expected = Detokenizer(tok, [], skip), ""
    for i in range(1, len(ids) + 1):
        before = det.text
        det.update(ids[:i])
        grows = det.text.startswith(before)
        assert grows or tok.clean_up_spaces or (not exact_on_junk and "\ufffd" in det.text), (i, ids[:i])
        expected = whole(tok, ids[:i], skip) or expected
        if exact_on_junk or "\ufffd" not in expected:
            assert det.text == expected, (i, ids[:i])
    return det


def sequences(tok, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    out = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    out += [[rng.randrange(vocab) for _ in range(200)] for _ in range(20)]  # broken bytes, specials
    return out


@pytest.mark.parametrize("skip", [True, False])
def test_default_model_tokenizer(smollm2, skip):
    for ids in sequences(smollm2, len(smollm2)):
        stream_matches_whole(smollm2, ids, skip)


def test_default_model_multibyte_split(smollm2):
    """A character whose bytes come in several tokens is held back until it is complete."""
    ids = smollm2.encode("😀 ok", add_special_tokens=False)
    det = Detokenizer(smollm2, [])
    texts = []
    for i in range(1, len(ids) + 1):
        det.update(ids[:i])
        texts.append(det.text)
    assert all("\ufffd" not in t for t in texts) and texts[-1] == "😀 ok"


@pytest.mark.parametrize("skip", [True, False])
def test_finish_gives_the_incremental_text_of_every_prefix(smollm2, skip):
    """finish (a final-only request's one decode) ends where token-by-token updates end, a
    character cut in the middle of its bytes held back alike (the emoji and CJK text, cut at
    every token)."""
    for ids in [smollm2.encode(t, add_special_tokens=False) for t in TEXTS]:
        det = Detokenizer(smollm2, [], skip)
        for i in range(1, len(ids) + 1):
            det.update(ids[:i])
            once = Detokenizer(smollm2, [], skip)
            once.finish(ids[:i])
            assert once.text == det.text, (i, ids[:i])


def llama2_style(tmp_path) -> Tokenizer:
    """SentencePiece BPE as Llama 2 / Mistral ship it: "▁" for spaces, byte-fallback tokens
    for characters outside the vocabulary, the first leading space stripped on decode."""
    from tokenizers import Tokenizer as HF, decoders, normalizers
    from tokenizers.models import BPE

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("i", "n"), ("▁", "i"), ("▁i", "s"), ("e", "r"),
              ("▁", "P")]
    for p in ["▁", *"abcdefghijklmnopqrstuvwxyzTPI.,!'", *("".join(m) for m in merges)]:
        vocab.setdefault(p, len(vocab))
    model = BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tok = HF(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    return save(tmp_path, tok, {"clean_up_tokenization_spaces": False})


def wordpiece(tmp_path) -> Tokenizer:
    """BERT's WordPiece: "##" continuations, tokens joined with spaces, the decoder's own
    clean-up of spaces before punctuation."""
    from tokenizers import Tokenizer as HF, decoders, pre_tokenizers
    from tokenizers.models import WordPiece

    words = ["[UNK]", "[CLS]", "[SEP]", "the", "cat", "is", "n", "##'", "##t", "'", "s", ".", ",", "!", "?", "it",
             "##s", "play", "##ing", "a", "b"]
    tok = HF(WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=True)
    tok.add_special_tokens(["[CLS]", "[SEP]"])
    return save(tmp_path, tok, {"clean_up_tokenization_spaces": False})


def save(tmp_path, tok, config: dict) -> Tokenizer:
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer(tmp_path)


@pytest.mark.parametrize("make", [llama2_style, wordpiece])
@pytest.mark.parametrize("skip", [True, False])
def test_other_decoders(tmp_path, make, skip):
    tok = make(tmp_path)
    texts = TEXTS + ["the cat isn't playing , it's a b ! ? the  cat", "Pé ü 🙂 the the"]
    seqs = [tok.encode(t, add_special_tokens=False) for t in texts]
    rng = random.Random(1)
    seqs += [[rng.randrange(len(tok)) for _ in range(120)] for _ in range(30)]
    for ids in seqs:
        stream_matches_whole(tok, ids, skip, exact_on_junk=make is not llama2_style)


def test_clean_up_spaces(smollm2, tmp_path):
    """transformers' clean_up_tokenization can take the space before a new "." from the text
    already sent: the window's text then does not start with its context's, and that token's
    text comes from a whole decode."""
    src = smollm2._tok
    src.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"clean_up_tokenization_spaces": True}))
    tok = Tokenizer(tmp_path)
    assert tok.clean_up_spaces
    ids = tok.encode("It is n't here . Is it ? Yes , it 's there !", add_special_tokens=False)
    stream_matches_whole(tok, ids)
    for ids in sequences(tok, len(tok), seed=3)[:6]:
        stream_matches_whole(tok, ids)


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_the_same_text(smollm2, include):
    text = "alpha beta. gamma; delta END of it. More after END."
    ids = smollm2.encode(text, add_special_tokens=False)
    for stop in (["END"], [";", "END"], [". g"], ["a be"], ["not there"]):
        det = Detokenizer(smollm2, stop, include_stop_str_in_output=include)
        matched = None
        for i in range(1, len(ids) + 1):
            matched = det.update(ids[:i])
            if matched is not None:
                break
        hits = [(text.find(s), s) for s in stop if s in text]
        if not hits:
            assert matched is None and det.text == text
            continue
        at, s = min(hits)
        assert matched == s
        assert det.text == (text[: at + len(s)] if include else text[:at])


def test_no_new_token_changes_nothing(smollm2):
    ids = smollm2.encode("Hello there", add_special_tokens=False)
    det = Detokenizer(smollm2, ["zzz"])
    det.update(ids)
    before = det.text
    assert det.update(ids) is None and det.text == before  # e.g. an EOS's update, its id left out
