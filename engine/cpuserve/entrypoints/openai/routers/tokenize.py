"""POST /tokenize and /detokenize (vLLM's utility endpoints)."""
from __future__ import annotations

from fastapi import APIRouter, Request

from cpuserve.entrypoints.openai import links
from cpuserve.entrypoints.openai.errors import APIError
from cpuserve.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from cpuserve.entrypoints.openai.serving import rendered, server_state

router = APIRouter()


@router.post("/tokenize", operation_id="tokenize", responses=links.responses("tokenize"))
async def tokenize(req: TokenizeRequest, request: Request):
    st = server_state(request)
    st.check_model(req.model, task=None)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt or messages")
    tok = st.tokenizer
    if req.messages is not None:
        ids = tok.encode(rendered(req, tok), add_special_tokens=False)
    else:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    out = {"tokens": ids, "count": len(ids), "max_model_len": st.engine.info.max_model_len}
    if req.return_token_strs:  # the vocabulary's piece for each id (byte-level pieces as the vocabulary spells them)
        out["token_strs"] = st.tokenizer.convert_ids_to_tokens(ids)
    return out


@router.post("/detokenize", operation_id="detokenize", responses=links.responses("detokenize"))
async def detokenize(req: DetokenizeRequest, request: Request):
    st = server_state(request)
    st.check_model(req.model, task=None)
    vocab = st.engine.info.vocab_size
    if any(t < 0 or t >= vocab for t in req.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": st.tokenizer.decode(req.tokens)}
