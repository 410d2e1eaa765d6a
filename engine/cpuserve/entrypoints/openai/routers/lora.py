"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, vLLM's runtime LoRA updates, served
as vLLM serves them: only where VLLM_ALLOW_RUNTIME_LORA_UPDATING is true (the routes are absent
otherwise) and behind the API key. The engine core loads or unloads between its steps; an
adapter is unloaded only once no request runs with it, and a name loaded again never matches the
prefix-cache blocks of its previous load."""
from __future__ import annotations

import os

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from cpuserve.engine.async_engine import EngineDeadError
from cpuserve.entrypoints.openai.errors import APIError
from cpuserve.entrypoints.openai.protocol import RequestBody
from cpuserve.entrypoints.openai.serving import api_error, server_state

router = APIRouter()


def runtime_updates_allowed() -> bool:
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")


class LoadLoRAAdapter(RequestBody):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapter(RequestBody):
    lora_name: str
    lora_int_id: int | None = None


@router.post("/v1/load_lora_adapter", operation_id="load_lora_adapter")
async def load_lora_adapter(req: LoadLoRAAdapter, request: Request):
    st = server_state(request)
    if not st.engine.config.enable_lora:
        raise APIError(400, "LoRA adapters need the server started with --enable-lora", param="lora_name")
    if not req.lora_name or req.lora_name in (st.served_model_name, *st.aliases):
        raise APIError(400, f"'{req.lora_name}' cannot name an adapter: it is empty or the served model's name",
                       param="lora_name")
    if req.lora_name in st.loras:
        raise APIError(400, f"The lora adapter '{req.lora_name}' has already been loaded.", param="lora_name")
    failed = await change(st, "load", req.lora_name, req.lora_path)
    if failed:
        raise APIError(failed[0], failed[1], param="lora_path")
    st.loras[req.lora_name] = req.lora_path
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", operation_id="unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoRAAdapter, request: Request):
    st = server_state(request)
    failed = await change(st, "unload", req.lora_name)
    if failed:
        status, message = failed
        raise APIError(status, message, "not_found_error" if status == 404 else "invalid_request_error",
                       param="lora_name")
    st.loras.pop(req.lora_name, None)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


async def change(st, op: str, name: str, path: str | None = None) -> tuple[int, str] | None:
    try:
        return await st.engine.change_lora(op, name, path)
    except EngineDeadError as e:
        raise api_error(e, "lora_name") from None

