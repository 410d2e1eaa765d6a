"""OpenAI-shaped errors: one exception for the routes to raise, one JSON body for
every error the server answers (validation, not found, rejected, unavailable)."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
    return JSONResponse(APIError(status, message, type_, param).body(), status_code=status)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One message naming every invalid field, and the first field as `param`."""
    errs = exc.errors()
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":  # its loc is a character position, not a field
        where = first.get("loc", ("body", "?"))[-1]
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'decode error')} " \
               f"(at character {where})", None
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    msg = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in errs)
    return msg or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError):
        msg, param = validation_message(exc)
        return error_response(400, msg, param=param)

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind)
