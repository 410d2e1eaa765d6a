"""A GGUF file's tokenizer as tokenizer.json + tokenizer_config.json, built
with the `tokenizers` library alone (no transformers, no torch): the engine
images carry neither transformers nor a torch new enough for it.

The result is what transformers' GGUF conversion gives for byte-level BPE
vocabularies (`tokenizer.ggml.model == "gpt2"`: SmolLM, Qwen, Llama 3, ...):
the same vocabulary, merges, split regex, added tokens and special tokens
(tests compare the two on the real model). WordPiece vocabularies (`"bert"`)
are rebuilt as BERT's own tokenizer (llama.cpp's converter marks word starts
with "▁" where BERT marks continuations with "##"; tests compare the token ids
with the original model's tokenizer). Sentencepiece vocabularies (`"llama"`)
are handed to transformers when it is installed, and refused with a clear
message when it is not.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regex the vocabulary's merges were learned with; a
# name not listed keeps GPT-2's own split (ByteLevel's built-in regex)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    """The vocabulary in the byte alphabet (a few files spell some tokens in plain text)."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    return {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
            for i, t in enumerate(tokens)}


def _post_processor(bos: str | None, eos: str | None, vocab: dict[str, int]):
    from tokenizers import processors

    single = ([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else [])
    pair = single + [f"{bos}:1"] * bool(bos) + ["$B:1"] + [f"{eos}:1"] * bool(eos)
    specials = [(t, vocab[t]) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair), special_tokens=specials)


def byte_level_tokenizer(meta: dict):
    """Byte-level BPE with the file's merges, split regex and added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens, types = meta["tokens"], meta.get("token_type") or [1] * len(meta["tokens"])
    vocab = _byte_level_vocab(tokens)
    merges = [tuple(m.split(" ")) for m in meta.get("merges", [])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    split = PRE_TOKENIZER_SPLITS.get(meta.get("pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    alphabet = set(bytes_to_unicode().values())
    # a control token spelled outside the byte alphabet is a llama.cpp mislabel: adding it
    # would grow the vocabulary past the model's (transformers skips it too)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab])
    bos = meta["special"].get("bos_token") if meta.get("add_bos_token") else None
    eos = meta["special"].get("eos_token") if meta.get("add_eos_token") else None
    tok.post_processor = _post_processor(bos, eos, vocab)
    return tok


def wordpiece_tokenizer(meta: dict):
    """BERT's WordPiece tokenizer from a GGUF vocabulary: "▁word" -> "word", "piece" ->
    "##piece", control tokens ([CLS], [SEP], ...) as they are; [CLS] $A [SEP] around a text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tokens, types = meta["tokens"], meta.get("token_type") or [1] * len(meta["tokens"])
    words = [t if ty == _CONTROL else t[1:] if t.startswith("\u2581") else "##" + t for t, ty in zip(tokens, types)]
    vocab = {w: i for i, w in reversed(list(enumerate(words)))}  # a duplicate spelling keeps its first id
    sp = meta["special"]
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token=sp.get("unk_token", "[UNK]"),
                                     continuing_subword_prefix="##", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=bool(meta.get("lowercase", True)))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([AddedToken(w, special=True) for w, ty in zip(words, types) if ty == _CONTROL])
    cls, sep = sp.get("bos_token", "[CLS]"), sp.get("sep_token", sp.get("eos_token", "[SEP]"))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    return tok


def read_metadata(reader) -> dict:
    """The tokenizer fields of an open gguf.GGUFReader, under short names."""
    def get(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    tokens = get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("the GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    meta = {"model": get("tokenizer.ggml.model"), "pre": get("tokenizer.ggml.pre"), "tokens": tokens,
            "token_type": get("tokenizer.ggml.token_type"), "chat_template": get("tokenizer.chat_template"),
            "add_bos_token": get("tokenizer.ggml.add_bos_token", _default_add_bos(get("tokenizer.ggml.model"))),
            "add_eos_token": get("tokenizer.ggml.add_eos_token", False),
            "lowercase": get("tokenizer.ggml.normalizer.lowercase", True)}
    if get("tokenizer.ggml.merges") is not None:
        meta["merges"] = get("tokenizer.ggml.merges")
    meta["special"] = {name: tokens[i] for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                                                          ("unk_token", "unknown_token_id"),
                                                          ("pad_token", "padding_token_id"),
                                                          ("sep_token", "seperator_token_id"),  # llama.cpp's spelling
                                                          ("mask_token", "mask_token_id"))
                       if (i := get(f"tokenizer.ggml.{key}")) is not None}
    return meta


def _default_add_bos(model: str | None) -> bool:
    # llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say otherwise
    return model == "llama"


def write_tokenizer(reader, gguf_path: Path, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json for the GGUF file into `out`."""
    meta = read_metadata(reader)
    if meta["model"] not in ("gpt2", "bert"):
        return _write_with_transformers(meta["model"], gguf_path, out)
    (wordpiece_tokenizer if meta["model"] == "bert" else byte_level_tokenizer)(meta).save(str(out / "tokenizer.json"))
    cfg = {**meta["special"], "add_bos_token": bool(meta["add_bos_token"]),
           "add_eos_token": bool(meta["add_eos_token"]), "clean_up_tokenization_spaces": False}
    if meta["chat_template"]:
        cfg["chat_template"] = meta["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def _write_with_transformers(model: str | None, gguf_path: Path, out: Path) -> None:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(f"{gguf_path}: its tokenizer is of type {model!r}; cpuserve converts byte-level BPE "
                         "('gpt2') GGUF vocabularies itself and needs transformers for any other; install "
                         "transformers or serve the model's Hugging Face directory") from None
    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(out))
