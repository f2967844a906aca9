"""Errors of the HTTP API as typed exceptions, turned into OpenAI-shaped bodies in one place.

Handlers never build error responses themselves: they raise one of these (or an auth error) and
``install_error_handlers`` renders ``{"error": {"message", "type", "param", "code"}}`` with the status.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ajet_hpc.engine.base import EngineNotRunning
from ajet_hpc.server.auth import AuthError, redact
from ajet_hpc.server.http_schemas import ErrorDetail, ErrorResponse

log = logging.getLogger(__name__)


class APIError(Exception):
    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class BadRequest(APIError):
    pass


class NotFound(APIError):
    status_code = 404
    error_type = "not_found_error"


class Conflict(APIError):
    status_code = 409
    error_type = "conflict_error"


class Unavailable(APIError):
    status_code = 503
    error_type = "service_unavailable"


ENGINE_NOT_RUNNING = "engine_not_running"
"""The code of the 503 while the engine does not run (the server is going down); clients wait for it."""


def error_body(
    status: int, message: str, error_type: str, param: str | None, code: str | None
) -> JSONResponse:
    detail = ErrorDetail(message=message, type=error_type, param=param, code=code)
    return JSONResponse(status_code=status, content=ErrorResponse(error=detail).model_dump())


def _field_path(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    out = ""
    for part in parts:
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out or "body"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_body(exc.status_code, exc.message, exc.error_type, exc.param, exc.code)

    @app.exception_handler(EngineNotRunning)
    async def _engine_not_running(_: Request, exc: EngineNotRunning) -> JSONResponse:
        # outside a model call (the tokenizer of a stopped engine): the server is going down, as in serving
        return error_body(503, str(exc), Unavailable.error_type, None, ENGINE_NOT_RUNNING)

    @app.exception_handler(AuthError)
    async def _auth_error(_: Request, exc: AuthError) -> JSONResponse:
        error_type = "authentication_error" if exc.status_code == 401 else "permission_error"
        return error_body(exc.status_code, str(exc), error_type, None, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request", "type": ""}
        if first.get("type") == "json_invalid":
            return error_body(
                400, "request body is not valid JSON", "invalid_request_error", None, "invalid_json"
            )
        path = _field_path(tuple(first.get("loc", ())))
        message = "; ".join(f"{_field_path(tuple(e['loc']))}: {e['msg']}" for e in errors[:5])
        return error_body(400, message, "invalid_request_error", path, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return error_body(exc.status_code, str(exc.detail), "invalid_request_error", None, code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, redact(str(request.url.path)))
        return error_body(500, f"internal error: {type(exc).__name__}", "server_error", None, None)
