"""The OpenAI-compatible HTTP API of `ggx serve` (FastAPI on uvicorn).

Routes: POST /v1/chat/completions, POST /v1/completions (both stream as server-sent events with
`stream: true`), GET /v1/models, GET /health (never behind the API key), GET /metrics
(Prometheus text). Every error is OpenAI's JSON shape, `{"error": {"message", "type", "param",
"code"}}`, with a 4xx status for what the client got wrong (400 bad fields or JSON, 401 a missing
or wrong key, 404, 405, 413 a body over the limit, 503 + Retry-After when every slot is busy and
the queue is full) and 500 for a bug, never a traceback.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..errors import GGXError
from ..models.model import Model
from .engine import Done, Engine, Job, QueueFull, Token
from .schema import ChatRequest, CompletionRequest

#: the largest request body accepted (bytes); a larger one is answered 413
DEFAULT_MAX_BODY = 1 << 20
RETRY_AFTER_S = 1
#: finish reasons as OpenAI names them
FINISH = {"eos": "stop", "stop": "stop", "max_tokens": "length", "context_full": "length"}


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), e.status, headers=e.headers)


@dataclass
class ServeConfig:
    model_id: str
    api_key: str | None = None
    max_body: int = DEFAULT_MAX_BODY


class Guard:
    """ASGI middleware in front of every route: the API key (all but /health) and the body size
    limit (the body is read here, at most `max_body` bytes, and handed on)."""

    def __init__(self, app: Callable, config: ServeConfig):
        self.app = app
        self.config = config

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        key = self.config.api_key
        if key and scope.get("path") != "/health":
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                await _error_response(APIError(401, "a valid API key is required: Authorization: Bearer KEY",
                                               code="invalid_api_key"))(scope, receive, send)
                return
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            limit = self.config.max_body
            too_big = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
            try:
                declared = int(headers.get("content-length", "0"))
            except ValueError:
                declared = 0
            if declared > limit:
                await _error_response(too_big)(scope, receive, send)
                return
            chunks, size = [], 0
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                body = msg.get("body", b"")
                size += len(body)
                if size > limit:
                    await _error_response(too_big)(scope, receive, send)
                    return
                chunks.append(body)
                if not msg.get("more_body", False):
                    break
            whole, replayed = b"".join(chunks), False

            async def replay() -> dict:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": whole, "more_body": False}
                return await receive()

            await self.app(scope, replay, send)
            return
        await self.app(scope, receive, send)


class StopText:
    """Stop sequences over streamed text: `feed` returns the text that can be sent (holding back a
    tail that may be the start of a stop sequence) and whether a stop sequence was met (the text
    ends before it, as OpenAI's does)."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        self.held += text
        if not self.stops:
            out, self.held = self.held, ""
            return out, False
        found = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if found:
            out, self.held = self.held[:min(found)], ""
            return out, True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.held)), keep, -1):
                if self.held.endswith(s[:n]):
                    keep = n
                    break
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


def create_app(model: Model, engine: Engine, config: ServeConfig) -> FastAPI:
    """The API over `engine` (started and stopped with the app) serving `model`."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="ggx", lifespan=lifespan)
    n_ctx_seq = engine.batcher.n_ctx_seq
    started = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        # a union (str | list) fails once per member: the error that is not "wrong type" says more
        first = next((x for x in errors if not str(x.get("type", "")).endswith("_type")), errors[0] if errors else {})
        param = ".".join(str(x) for x in first.get("loc", ()) if _field_name(x)) or None
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg, param = "the request body is not valid JSON", None
        elif param:
            msg = f"{param}: {msg}"
        return _error_response(APIError(400, msg, param=param))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else None
        return JSONResponse(error_body(str(e.detail), code=code), e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), 500)

    def prompt_job(ids: list[int], req: ChatRequest | CompletionRequest, logprobs: bool, top_logprobs: int) -> Job:
        if not ids:
            raise APIError(400, "the prompt has no tokens", param="prompt")
        if len(ids) > n_ctx_seq:
            raise APIError(400, f"the prompt has {len(ids)} tokens, more than a slot's context of {n_ctx_seq}",
                           param="messages" if isinstance(req, ChatRequest) else "prompt",
                           code="context_length_exceeded")
        limit = req.limit()
        room = n_ctx_seq - len(ids)
        if limit is None:
            limit = room
        elif limit > room:
            raise APIError(400, f"max_tokens {limit} + the prompt's {len(ids)} tokens are more than a slot's "
                                f"context of {n_ctx_seq}", param="max_tokens", code="context_length_exceeded")
        try:
            model.encode_prompt(ids)
        except GGXError as e:
            raise APIError(400, str(e), param="prompt") from None
        seed = req.seed if req.seed is not None and req.seed >= 0 else None  # llama-server's -1: a random seed
        return Job(ids, limit, req.temperature, req.top_k, req.top_p, seed, logprobs=logprobs,
                   top_logprobs=top_logprobs)

    def submit(job: Job) -> None:
        job.loop, job.queue = asyncio.get_running_loop(), asyncio.Queue()
        try:
            engine.submit(job)
        except QueueFull as e:
            raise APIError(503, str(e), "server_busy", code="server_busy",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    def token_text(tid: int) -> str:
        return model.tokenizer.token_bytes(tid).decode("utf-8", "replace")

    def token_bytes(tid: int) -> list[int]:
        return list(model.tokenizer.token_bytes(tid))

    def chat_logprob(t: Token) -> dict[str, Any]:
        return {"token": token_text(t.id), "logprob": t.logprob, "bytes": token_bytes(t.id),
                "top_logprobs": [{"token": token_text(i), "logprob": lp, "bytes": token_bytes(i)} for i, lp in t.top]}

    async def tokens(request: Request, job: Job,
                     stops: StopText) -> AsyncIterator[tuple[str, Token | None, str | None]]:
        """(text to send, its token, finish reason when it is the end) until the job is done; the
        job is cancelled when this ends early (the client went away, a stop sequence)."""
        finished = stopped = False
        try:
            while True:
                try:
                    item = await asyncio.wait_for(job.queue.get(), timeout=0.5)
                except TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if isinstance(item, Done):
                    finished = True
                    if item.finish_reason == "error":
                        raise APIError(500, f"generation failed: {item.error}", "server_error")
                    yield stops.flush(), None, FINISH.get(item.finish_reason, "stop")
                    return
                text, stopped = stops.feed(item.text)
                if stopped:
                    yield text, item, None
                    yield "", None, "stop"
                    return
                yield text, item, None
        finally:
            if not finished:
                engine.cancel(job, client_gone=not stopped)

    def usage(job: Job, n: int) -> dict[str, int]:
        return {"prompt_tokens": len(job.prompt), "completion_tokens": n, "total_tokens": len(job.prompt) + n}

    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def respond(request: Request, req: ChatRequest | CompletionRequest, job: Job, chat: bool) -> Response:
        stops = StopText(req.stops())
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        want_logprobs = job.logprobs

        def head(choices: list) -> dict[str, Any]:
            return {"id": rid, "object": obj + (".chunk" if chat and req.stream else ""), "created": created,
                    "model": config.model_id, "choices": choices}

        if req.stream:
            async def events() -> AsyncIterator[str]:
                n = 0
                if chat:
                    yield sse(head([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]))
                try:
                    async for text, tok, finish in tokens(request, job, stops):
                        n += tok is not None
                        lp = None
                        if want_logprobs and tok is not None:
                            lp = {"content": [chat_logprob(tok)]} if chat else _completion_logprobs([tok], token_text)
                        if not text and finish is None and lp is None:
                            continue
                        delta = ({"content": text} if text else {}) if chat else None
                        choice = {"index": 0, "logprobs": lp, "finish_reason": finish}
                        choice.update({"delta": delta} if chat else {"text": text})
                        yield sse(head([choice]))
                except APIError as e:
                    yield sse(error_body(e.message, e.type))
                    return
                if req.stream_options is not None and req.stream_options.include_usage:
                    yield sse({**head([]), "usage": usage(job, n)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        parts, toks, finish = [], [], "stop"
        async for text, tok, fin in tokens(request, job, stops):
            parts.append(text)
            if tok is not None:
                toks.append(tok)
            if fin is not None:
                finish = fin
        text = "".join(parts)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                      "logprobs": {"content": [chat_logprob(t) for t in toks]} if want_logprobs else None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish,
                      "logprobs": _completion_logprobs(toks, token_text) if want_logprobs else None}
        return JSONResponse({**head([choice]), "usage": usage(job, len(toks))})

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request) -> Response:
        try:
            text = model.chat_template.render([{"role": m.role if m.role != "developer" else "system",
                                                "content": m.text()} for m in req.messages])
        except GGXError as e:
            raise APIError(400, str(e), param="messages") from None
        job = prompt_job(model.tokenize(text), req, bool(req.logprobs), req.top_logprobs or 0)
        submit(job)
        return await respond(request, req, job, chat=True)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        ids = model.tokenize(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        job = prompt_job(ids, req, req.logprobs is not None, req.logprobs or 0)
        submit(job)
        return await respond(request, req, job, chat=False)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model_id, "object": "model", "created": started,
                                            "owned_by": "ggx", "meta": {"n_ctx_slot": n_ctx_seq,
                                                                         "n_vocab": model.n_vocab}}]}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        busy = engine.slots_busy
        return {"status": "ok", "slots_idle": engine.batcher.n_seq - busy, "slots_processing": busy,
                "queued": engine.queued}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        c, st = engine.counters, engine.batcher.stats
        rows = [
            ("requests_total", "counter", "requests accepted", c.requests),
            ("requests_rejected_total", "counter", "requests answered 503 (queue full)", c.requests_rejected),
            ("requests_cancelled_total", "counter", "requests whose client went away", c.requests_cancelled),
            ("prompt_tokens_total", "counter", "prompt tokens evaluated", st.prompt_tokens),
            ("generated_tokens_total", "counter", "tokens generated", c.generated_tokens),
            ("slots_busy", "gauge", "slots holding a sequence", engine.slots_busy),
            ("slots_total", "gauge", "parallel slots", engine.batcher.n_seq),
            ("requests_queued", "gauge", "requests waiting for a slot", engine.queued),
            ("prompt_tokens_per_second", "gauge", "prompt tokens per second of prefill",
             st.prompt_tokens / st.prompt_s if st.prompt_s else 0.0),
            ("decode_tokens_per_second", "gauge", "generated tokens per second of decode steps",
             st.decode_tokens / st.decode_s if st.decode_s else 0.0),
        ]
        lines = []
        for name, kind, what, value in rows:
            lines += [f"# HELP ggx_{name} {what}", f"# TYPE ggx_{name} {kind}", f"ggx_{name} {value}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    app.add_middleware(Guard, config=config)
    return app


#: what pydantic puts in an error's location for the member of a union that failed
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "body"}


def _field_name(loc: str | int) -> bool:
    """Whether a pydantic error location element names a field or an index (not a union member)."""
    return isinstance(loc, int) or (loc.isidentifier() and loc not in _UNION_TAGS)


def _completion_logprobs(toks: list[Token], text: Callable[[int], str]) -> dict[str, Any]:
    offsets, at = [], 0
    for t in toks:
        offsets.append(at)
        at += len(t.text)
    return {"tokens": [text(t.id) for t in toks], "token_logprobs": [t.logprob for t in toks],
            "top_logprobs": [{text(i): lp for i, lp in t.top} for t in toks], "text_offset": offsets}
