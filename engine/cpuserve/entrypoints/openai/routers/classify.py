"""POST /classify (vLLM's route; also /v1/classify, as SGLang serves it) on a classification
model: each input's class probabilities, its most likely label (config.json's id2label) and the
number of classes. Inputs take /v1/embeddings' shapes: a text, texts, token ids or lists of them;
each is one engine request, batched by the core with the others."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from cpuserve.entrypoints.openai.protocol import RequestBody, now
from cpuserve.entrypoints.openai.routers.embeddings import classifier_head, embed_all, tokenize_inputs
from cpuserve.entrypoints.openai.serving import server_state

router = APIRouter()


class ClassificationRequest(RequestBody):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    user: str | None = None


@router.post("/classify", operation_id="classify")
@router.post("/v1/classify", operation_id="classify_v1", include_in_schema=False)
async def classify(req: ClassificationRequest, request: Request):
    st = server_state(request)
    st.check_model(req.model, task="classify")
    inputs = await asyncio.to_thread(tokenize_inputs, req.input, st.tokenizer)
    head = classifier_head(st)
    outs = await embed_all(st, request, inputs, "input")
    data = [{"index": i, "label": head.label(o.embedding), "probs": head.probs(o.embedding),
             "num_classes": len(o.embedding)} for i, o in enumerate(outs)]
    n = sum(o.num_tokens for o in outs)
    return {"id": f"classify-{request.state.request_id}", "object": "list", "created": now(),
            "model": st.served_model_name, "data": data,
            "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}}
