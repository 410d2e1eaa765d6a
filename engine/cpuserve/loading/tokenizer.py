"""The model's tokenizer and chat template, read from tokenizer.json and
tokenizer_config.json with the `tokenizers` library and jinja2, without
importing transformers. Encoding, decoding and chat templates give what
transformers' fast tokenizer gives (tests compare them)."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path


def _token_str(v) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v


def _clean_up_spaces(text: str) -> str:
    # transformers' clean_up_tokenization
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


@lru_cache(maxsize=16)
def _compile_template(template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class Tokenizer:
    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ValueError(f"{model_dir}: no tokenizer.json (a fast tokenizer is required)")
        self._tok = HFTokenizer.from_file(str(path))
        # as transformers: a tokenizer.json's stored padding / truncation apply only when asked for
        self._tok.no_padding()
        self._tok.no_truncation()
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        special_path = model_dir / "special_tokens_map.json"
        special = json.loads(special_path.read_text()) if special_path.exists() else {}
        get = lambda k: _token_str(cfg.get(k)) or _token_str(special.get(k))  # noqa: E731
        self.bos_token, self.eos_token = get("bos_token"), get("eos_token")
        self.pad_token, self.unk_token = get("pad_token"), get("unk_token")
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.clean_up_spaces = bool(cfg.get("clean_up_tokenization_spaces", False))
        template = cfg.get("chat_template")
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text()
        if isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """Two texts as one input through the tokenizer's pair template ([CLS] a [SEP] b [SEP]
        for BERT): the ids and their token type ids (segment 0, then 1), as a cross-encoder reads them."""
        enc = self._tok.encode(first, second)
        return enc.ids, enc.type_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_spaces else text

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self._tok.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, continue_final_message: bool = False,
                            **kwargs) -> str:
        """The conversation as the template renders it; `kwargs` are further template variables
        (tools, a request's chat_template_kwargs). `continue_final_message`: the text ends with the
        last message's content, left open for the model to continue (vLLM's and transformers')."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this model has no chat template; pass chat_template= or use completions")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set: the last "
                             "message is either continued or answered")
        text = _compile_template(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
            eos_token=self.eos_token or "", pad_token=self.pad_token, unk_token=self.unk_token, **kwargs)
        return continue_final(text, messages) if continue_final_message else text


def continue_final(text: str, messages: list[dict]) -> str:
    """The rendered conversation cut after its last message's content (what follows it: the
    template's end-of-turn markers), as transformers' continue_final_message cuts it."""
    final = messages[-1].get("content") if messages else None
    if isinstance(final, list):
        final = "".join(p.get("text", "") for p in final if isinstance(p, dict))
    if not final:
        raise ValueError("continue_final_message needs a last message with content to continue")
    for part in (final, final.strip()):
        at = text.rfind(part)
        if part and at >= 0:
            return text[:at + len(part)]
    raise ValueError("continue_final_message: the chat template does not render the last message's content")


def load_tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


def apply_chat_template(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        chat_template: str | None = None, continue_final_message: bool = False, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt, chat_template, continue_final_message,
                                         **kwargs)
