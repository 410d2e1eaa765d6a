"""OpenAPI links between the routes (what one answer gives that another request takes), for
clients and for stateful fuzzing (schemathesis chains calls along them): token ids from
/tokenize into /detokenize, /v1/completions and /v1/embeddings; generated text back into
/tokenize. Each route names its operationId; `responses(op)` is its decorator's `responses=`."""
from __future__ import annotations

_LINKS: dict[str, dict[str, tuple[str, dict]]] = {
    "tokenize": {
        "DetokenizeTheTokens": ("detokenize", {"tokens": "$response.body#/tokens"}),
        "CompleteTheTokens": ("completions", {"prompt": "$response.body#/tokens", "max_tokens": 3}),
        "EmbedTheTokens": ("embeddings", {"input": "$response.body#/tokens"}),
    },
    "detokenize": {
        "TokenizeTheText": ("tokenize", {"prompt": "$response.body#/prompt"}),
        "CompleteTheText": ("completions", {"prompt": "$response.body#/prompt", "max_tokens": 3}),
    },
    "completions": {
        "TokenizeTheCompletion": ("tokenize", {"prompt": "$response.body#/choices/0/text"}),
    },
    "chat_completions": {
        "TokenizeTheReply": ("tokenize", {"prompt": "$response.body#/choices/0/message/content"}),
    },
}


def responses(operation: str) -> dict:
    links = {name: {"operationId": target, "requestBody": body} for name, (target, body) in
             _LINKS.get(operation, {}).items()}
    return {200: {"description": "Successful Response", **({"links": links} if links else {})}}
