"""POST /v1/embeddings: OpenAI's shape, served by an embedding (pooling) model. Each input
is one engine request; the engine core batches concurrent ones."""
from __future__ import annotations

import asyncio
import base64
import json
import struct
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import Field

from cpuserve.engine.async_engine import EngineDeadError, Overloaded, RequestRejected
from cpuserve.entrypoints.openai import links
from cpuserve.entrypoints.openai.errors import APIError
from cpuserve.entrypoints.openai.protocol import RequestBody
from cpuserve.entrypoints.openai.serving import ServerState, api_error, server_state
from cpuserve.entrypoints.scoring import ClassifierHead

router = APIRouter()
MAX_INPUTS = 2048


class EmbeddingRequest(RequestBody):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


@router.post("/v1/embeddings", operation_id="embeddings", responses=links.responses("embeddings"))
async def embeddings(req: EmbeddingRequest, request: Request):
    st = server_state(request)
    st.check_model(req.model, task="embed")
    inputs = await asyncio.to_thread(tokenize_inputs, req.input, st.tokenizer)
    dims = check_dimensions(req.dimensions, st.engine.info.model_dir)
    outs = await embed_all(st, request, inputs, "input")
    data = [{"object": "embedding", "index": i, "embedding": encode(truncate(o.embedding, dims), req.encoding_format)}
            for i, o in enumerate(outs)]
    n = sum(o.num_tokens for o in outs)
    return {"object": "list", "data": data, "model": st.served_model_name,
            "usage": {"prompt_tokens": n, "total_tokens": n}}


async def embed_all(st: ServerState, request: Request, inputs: list[list[int]], param: str,
                    types: list[list[int]] | None = None) -> list:
    """One engine request per input (`types`: each one's token type ids), all in flight at once
    (the core batches them); the outputs (embeddings, or a classifier's logits) in the inputs'
    order, an engine refusal as the HTTP error that names `param`."""
    base = f"{request.state.request_id}-{uuid.uuid4().hex[:8]}"
    kinds = types or [None] * len(inputs)
    try:
        return await asyncio.gather(*(st.engine.embed(f"{base}-{i}", ids, t)
                                      for i, (ids, t) in enumerate(zip(inputs, kinds))))
    except (RequestRejected, Overloaded, EngineDeadError) as e:
        raise api_error(e, param) from None


def tokenize_inputs(inp, tok) -> list[list[int]]:
    if isinstance(inp, str):
        inp = [inp]
    elif inp and all(isinstance(x, int) for x in inp):
        inp = [inp]
    if not inp:
        raise APIError(400, "input must not be empty", param="input")
    if len(inp) > MAX_INPUTS:
        raise APIError(400, f"input may hold at most {MAX_INPUTS} items, got {len(inp)}", param="input")
    out = [tok.encode(x) if isinstance(x, str) else list(x) for x in inp]
    if any(not ids for ids in out):
        raise APIError(400, "an input is empty", param="input")
    return out


def classifier_head(st: ServerState) -> ClassifierHead:
    """The served classifier's labels and activations (its config.json and --hf-overrides, read once)."""
    return _classifier_head(st.engine.info.model_dir, json.dumps(st.engine.config.hf_overrides or {}))


@lru_cache(maxsize=4)
def _classifier_head(model_dir: str, overrides: str) -> ClassifierHead:
    return ClassifierHead.from_dir(model_dir, json.loads(overrides))


@lru_cache(maxsize=4)
def _matryoshka(model_dir: str) -> tuple[bool, tuple[int, ...]]:
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False, ()
    dims = tuple(cfg.get("matryoshka_dimensions") or ())
    return bool(cfg.get("is_matryoshka") or dims), dims


def check_dimensions(dims: int | None, model_dir: str) -> int | None:
    """`dimensions` only where the model was trained for it (Matryoshka), as vLLM allows it."""
    if dims is None:
        return None
    ok, allowed = _matryoshka(model_dir)
    if not ok or (allowed and dims not in allowed):
        raise APIError(400, "this model does not support `dimensions` (it is not a Matryoshka model)"
                       if not ok else f"dimensions must be one of {list(allowed)}", param="dimensions")
    return dims


def truncate(v: list[float], dims: int | None) -> list[float]:
    if dims is None or dims >= len(v):
        return v
    head = v[:dims]
    norm = sum(x * x for x in head) ** 0.5 or 1.0
    return [x / norm for x in head]


def encode(v: list[float], fmt: str):
    """float: the list; base64: little-endian float32 bytes, as OpenAI and vLLM send them."""
    return v if fmt == "float" else base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
