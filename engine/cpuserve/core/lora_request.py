"""vLLM's LoRARequest: the adapter a request runs with, named as requests select it (the
server's --lora-modules name, the OpenAI `model` field), with vLLM's integer id and its path."""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


def parse_modules(items: list[str] | None) -> dict[str, str]:
    """vLLM's --lora-modules: `name=path` or a JSON object {"name": ..., "path": ...} each."""
    out: dict[str, str] = {}
    for item in items or []:
        if item.lstrip().startswith("{"):
            try:
                obj = json.loads(item)
                name, path = obj["name"], obj["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules: {item!r} is not name=path or a JSON object with "
                                "\"name\" and \"path\"") from None
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {item!r} is not name=path")
        if name in out:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        out[name] = path
    return out
