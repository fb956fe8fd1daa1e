"""OpenAI error bodies with the right HTTP status, for every error the server can meet.

Body: `{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`. Statuses: invalid
JSON or parameters 400, missing or wrong API key 401, unknown model or route 404, body too large
413, queue full 429 with Retry-After, engine stopped or shutting down 503, our own bugs and
failures of the served model while running (a step that raised, an expert that could not be
read from the model file) 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moestream.errors import CapacityError, MoestreamError, RequestError

log = logging.getLogger("moestream.server")

_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered with the OpenAI error body. `headers` go out with it (Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_OF_STATUS.get(status, "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_moestream_error(e: MoestreamError) -> APIError:
    """RequestError and CapacityError (the request can never run): 400. Any other
    MoestreamError met while serving (ModelFormatError such as an ExpertReadError: the model
    file failed under us) is the server's failure, not the request's: 500."""
    status = 400 if isinstance(e, (RequestError, CapacityError)) else 500
    return APIError(status, str(e), code=type(e).__name__)


def internal_error(e: BaseException) -> APIError:
    return APIError(500, f"internal error: {type(e).__name__}: {e}")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {msg}", None
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    where = f"{param}: " if param else ""
    return f"invalid request: {where}{msg}{more}", param


def install_error_handlers(app: FastAPI) -> None:
    """Make every error leave the app as an OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return APIError(400, message, param=param).response()

    @app.exception_handler(MoestreamError)
    async def _moestream(request: Request, exc: MoestreamError) -> JSONResponse:
        return from_moestream_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        headers = dict(exc.headers) if exc.headers else None
        return APIError(exc.status_code, message, headers=headers).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return internal_error(exc).response()
