"""GET /v1/models and /v1/models/{id}: the served model (under each of its names) and its LoRA
adapters, each with the base model as its parent, as vLLM lists them."""
from __future__ import annotations

from fastapi import APIRouter, Request

from cpuserve.entrypoints.openai.protocol import now
from cpuserve.entrypoints.openai.serving import server_state

router = APIRouter()


def model_card(st, name: str) -> dict:
    info = st.engine.info
    card = {"id": name, "object": "model", "created": now(), "owned_by": "cpuserve",
            "root": info.model_dir if info else None, "parent": None,
            "max_model_len": info.max_model_len if info else None}
    if st.adapter(name):
        card.update(root=st.loras[name], parent=st.served_model_name)
    return card


@router.get("/v1/models", operation_id="list_models")
async def models(request: Request):
    st = server_state(request)
    return {"object": "list", "data": [model_card(st, n) for n in (st.served_model_name, *st.aliases, *st.loras)]}


@router.get("/v1/models/{model:path}", operation_id="retrieve_model")
async def model(model: str, request: Request):
    """OpenAI's retrieve (client.models.retrieve): the served model, or a 404 naming what is served."""
    st = server_state(request)
    st.check_model(model, task=None)
    return model_card(st, model)
