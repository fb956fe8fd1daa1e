"""The FastAPI app: routes, API key, body-size limit, lifespan; `serve(args)` runs it on uvicorn.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus), and vLLM's POST /tokenize, POST /detokenize, GET /tokenizer_info.
With an API key, every route but /health and /metrics needs `Authorization: Bearer KEY`.
Shutdown (SIGINT/SIGTERM): uvicorn stops accepting connections and lets in-flight requests run
for up to --timeout-graceful-shutdown seconds, then cancels them (which aborts their engine
requests); the lifespan then stops the engine thread, aborting whatever is left.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moestream.server.chat import create_chat_completion, render_chat_prompt
from moestream.server.completions import create_completion
from moestream.server.errors import APIError, bad_request, install_error_handlers
from moestream.server.metrics import CONTENT_TYPE
from moestream.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from moestream.server.serving import ServerConfig, ServerState

log = logging.getLogger("moestream.server")

_OPEN_PATHS = ("/health", "/metrics")


class _Guard:
    """Pure ASGI middleware: API key, request body limit, and request counting by status."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        status = {"code": 500}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            error = self._refuse(scope)
            if error is not None:
                await error.response()(scope, receive, counting_send)
                return
            await self.app(scope, self._limited(receive), counting_send)
        finally:
            route = path if path in _ROUTES else "other"
            self.state.metrics.http_requests.labels(route=route, status=str(status["code"])).inc()

    def _refuse(self, scope: Scope) -> APIError | None:
        headers = dict(scope["headers"])
        key = self.state.config.api_key
        if key is not None and scope["path"] not in _OPEN_PATHS:
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return APIError(
                    401, "missing or invalid API key (Authorization: Bearer ...)",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
                )  # fmt: skip
        length = headers.get(b"content-length")
        limit = self.state.config.max_request_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            return _too_large(limit)
        return None

    def _limited(self, receive: Receive) -> Receive:
        limit = self.state.config.max_request_bytes
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # FastAPI passes HTTPExceptions from here through
                    raise HTTPException(413, _too_large(limit).message)
            return message

        return limited_receive


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the limit of {limit} bytes")


_ROUTES = (
    "/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
    "/tokenize", "/detokenize", "/tokenizer_info",
)  # fmt: skip


def build_app(llm: Any, config: ServerConfig) -> FastAPI:
    """The app serving `llm` (an `moestream.llm.LLM`: engine, tokenizer, model)."""
    state = ServerState(llm, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.aengine.start()
        try:
            yield
        finally:
            await state.aengine.shutdown()

    app = FastAPI(title="moestream", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.moestream = state
    install_error_handlers(app)
    app.add_middleware(_Guard, state=state)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(state, req, raw)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(state, req, raw)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [
            ModelCard(id=name, root=str(llm.source.path), max_model_len=state.max_model_len)
            for name in config.model_names[:1]
        ]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/health")
    async def health() -> Response:
        if not state.aengine.is_running:
            raise APIError(503, "the engine is not running")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        state.check_model(req.model)
        tok = state.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            text = render_chat_prompt(
                state, req.messages, tools, req.add_generation_prompt,
                req.continue_final_message, req.chat_template_kwargs,
            )  # fmt: skip
            ids = tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = tok.encode(req.prompt, add_special_tokens=add)
        strs = [state.token_text(t) for t in ids] if req.return_token_strs else None
        body = TokenizeResponse(
            count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs
        )
        return JSONResponse(body.model_dump(exclude_none=True))

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        state.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < state.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary", "tokens")
        return JSONResponse(
            DetokenizeResponse(prompt=state.tokenizer.decode(req.tokens)).model_dump()
        )

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        tok = state.tokenizer

        def text(token_id: int | None) -> str | None:
            return None if token_id is None else tok.id_to_token(token_id)

        return JSONResponse(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": text(tok.eos_token_id),
                "bos_token": text(tok.bos_token_id),
                "pad_token": text(tok.pad_token_id),
                "add_bos_token": tok.add_bos,
                "add_eos_token": tok.add_eos,
                "chat_template": tok.chat_template,
                "model_max_length": state.max_model_len,
                "vocab_size": tok.vocab_size,
                "eos_token_ids": sorted(tok.eos_token_ids),
            }
        )

    return app


def model_names(model: str, served_model_name: str | None) -> list[str]:
    """Names clients may use: --served-model-name, else the file or folder name (without
    .gguf), plus the path as given."""
    if served_model_name:
        return [served_model_name]
    path = Path(model)
    stem = path.name[: -len(".gguf")] if path.name.endswith(".gguf") else path.name
    return [stem, model] if model != stem else [stem]


def serve(args: argparse.Namespace) -> int:
    """`moestream serve`: load the model, then run the server until SIGINT/SIGTERM."""
    import uvicorn

    from moestream.cli import _llm_from

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    llm = _llm_from(args)
    config = ServerConfig(
        model_names=model_names(args.model, args.served_model_name),
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_concurrency=args.max_concurrency,
        max_request_bytes=args.max_request_bytes,
    )
    app = build_app(llm, config)
    log.info(
        "serving %s as %r on http://%s:%d", args.model, config.model_names[0], args.host, args.port
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        timeout_graceful_shutdown=args.timeout_graceful_shutdown,
        log_level="info",
    )
    return 0
