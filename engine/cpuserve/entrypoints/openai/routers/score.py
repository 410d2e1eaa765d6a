"""POST /v1/score and /v1/rerank (vLLM's, the rerank one in Jina's and Cohere's shape, also at
/rerank and /v2/rerank), as vLLM scores:
- on an embedding model (a bi-encoder) a pair's score is the cosine similarity of its two texts'
  embeddings, each distinct text embedded once, as one engine request;
- on a classification model (a cross-encoder) the two texts are read together, one engine
  request a pair through the tokenizer's pair template, and the score is its one logit through
  the model's activation (sigmoid unless it names another).
The core batches the requests with the others."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import Field

from cpuserve.entrypoints.openai.errors import APIError
from cpuserve.entrypoints.openai.protocol import RequestBody, now
from cpuserve.entrypoints.openai.routers.embeddings import MAX_INPUTS, classifier_head, embed_all
from cpuserve.entrypoints.openai.serving import ServerState, server_state
from cpuserve.entrypoints.scoring import PairingError, cosine, pairs, ranked

router = APIRouter()


class ScoreRequest(RequestBody):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(RequestBody):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int = Field(0, ge=0)  # 0: every document
    return_documents: bool = True


async def embed_texts(st: ServerState, request: Request, texts: list[str], param: str) -> dict[str, tuple]:
    """{text: (embedding, tokens)} for each distinct text."""
    distinct = list(dict.fromkeys(texts))
    if len(distinct) > MAX_INPUTS:
        raise APIError(400, f"at most {MAX_INPUTS} distinct texts, got {len(distinct)}", param=param)
    ids = await asyncio.to_thread(lambda: [st.tokenizer.encode(t) for t in distinct])
    if any(not x for x in ids):
        raise APIError(400, "a text is empty", param=param)
    outs = await embed_all(st, request, ids, param)
    return {t: (o.embedding, o.num_tokens) for t, o in zip(distinct, outs)}


async def pair_scores(st: ServerState, request: Request, todo: list[tuple[str, str]],
                      param: str) -> tuple[list[float], int]:
    """Each pair's score and the tokens read in all, by the served model's kind."""
    if st.engine.info.task == "classify":
        if len(todo) > MAX_INPUTS:
            raise APIError(400, f"at most {MAX_INPUTS} pairs, got {len(todo)}", param=param)
        head = classifier_head(st)
        try:
            head.check_scores()  # a multi-label classifier is refused before any pair runs
            encoded = await asyncio.to_thread(lambda: [st.tokenizer.encode_pair(a, b) for a, b in todo])
            outs = await embed_all(st, request, [ids for ids, _ in encoded], param, [t for _, t in encoded])
            return [head.score(o.embedding) for o in outs], sum(o.num_tokens for o in outs)
        except PairingError as e:
            raise APIError(400, str(e), param=e.param) from None
    got = await embed_texts(st, request, [t for p in todo for t in p], param)
    return [cosine(got[a][0], got[b][0]) for a, b in todo], sum(got[a][1] + got[b][1] for a, b in todo)


@router.post("/v1/score", operation_id="score")
@router.post("/score", operation_id="score_root", include_in_schema=False)
async def score(req: ScoreRequest, request: Request):
    st = server_state(request)
    st.check_model(req.model, task=("embed", "classify"))
    try:
        todo = pairs(req.text_1, req.text_2)
    except PairingError as e:
        raise APIError(400, str(e), param=e.param) from None
    scores, n = await pair_scores(st, request, todo, "text_1")
    data = [{"index": i, "object": "score", "score": x} for i, x in enumerate(scores)]
    return {"id": f"score-{request.state.request_id}", "object": "list", "created": now(),
            "model": st.served_model_name, "data": data, "usage": {"prompt_tokens": n, "total_tokens": n}}


@router.post("/v1/rerank", operation_id="rerank")
@router.post("/rerank", operation_id="rerank_root", include_in_schema=False)
@router.post("/v2/rerank", operation_id="rerank_v2", include_in_schema=False)
async def rerank(req: RerankRequest, request: Request):
    st = server_state(request)
    st.check_model(req.model, task=("embed", "classify"))
    if not req.documents:
        raise APIError(400, "documents must not be empty", param="documents")
    scores, n = await pair_scores(st, request, [(req.query, d) for d in req.documents], "documents")
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": req.documents[i]}} if req.return_documents else {})}
               for i in ranked(scores, req.top_n)]
    return {"id": f"rerank-{request.state.request_id}", "model": st.served_model_name, "results": results,
            "usage": {"total_tokens": n}}
