"""GET /v1/models: the one served model."""
from __future__ import annotations

from fastapi import APIRouter, Request

from cpuserve.entrypoints.openai.protocol import now
from cpuserve.entrypoints.openai.serving import server_state

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request):
    st = server_state(request)
    info = st.engine.info
    return {"object": "list", "data": [{"id": st.served_model_name, "object": "model", "created": now(),
                                        "owned_by": "cpuserve", "root": info.model_dir if info else None,
                                        "max_model_len": info.max_model_len if info else None}]}
