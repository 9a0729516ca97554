"""An OpenAI-compatible HTTP server on the inference engine: `openk3 serve --model DIR`.

    app = create_app(engine, tokenizer, "k3-tiny", api_key=None)   # a FastAPI app (testable without a socket)
    server = Server(app).start()                                    # uvicorn on a thread, 127.0.0.1, a free port
    ... OpenAI(base_url=server.url + "/v1", api_key="-") ...
    server.stop()                                                   # finishes in-flight requests first

Routes: POST /v1/chat/completions and /v1/completions (streaming as server-sent events or not), GET /v1/models,
GET /health, GET /metrics (Prometheus text format).

One background thread (`EngineLoop`) runs `engine.step()` while the engine has work; every request handler submits
its prompt and waits on its own asyncio queue, which the engine thread fills through `loop.call_soon_threadsafe`.
So all concurrent requests share one continuous batch and one prefix cache. A client that disconnects is cancelled
in the engine (its pages and prefix-cache pins are freed at the next step).

The chat format is picked once per model from its tokenizer (`openk3.text.chat.chat_format_for`): K3's XTML when
it has K3's markers (the release, and every BPE trained here), else Kimi K2's template (docs/server.md). Prompts are
rendered by `openk3.text.chat.render` + `encode_segments`; generation stops at <|end_of_msg|> (XTML) or <|im_end|>
(K2); the output is split back into `reasoning_content`, `content` and `tool_calls` by `IdOutputParser`.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections import defaultdict
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Literal

import uvicorn
from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from openk3.model.checkpoint import load_for_inference
from openk3.serve.engine import (Engine, EngineConfig, Request, SamplingParams, StepOutput, add_compile_arg,
                                 add_threads_arg, compile_settings, set_threads)
from openk3.text import chat
from openk3.vision.model import expand_media_pads
from openk3.vision.preprocess import ImageError, decode_data_url, decode_image, num_image_tokens, preprocess

log = logging.getLogger("openk3.serve.server")

DEFAULT_MAX_TOKENS = 256  # when a request gives no max_tokens (also capped by the room left in the context)


# ------------------------------------------------------------------------------------------ errors

class APIError(Exception):
    """An error the client caused (or a server state it should know about), sent as OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


def error_body(message: str, type: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class TextDiff:
    """The new text of a growing decoded string, holding back a trailing U+FFFD (a multi-byte character whose
    remaining bytes are in the next token) until it resolves or the stream ends."""

    def __init__(self):
        self.sent = ""

    def update(self, text: str, final: bool = False) -> str:
        new = chat.grown_text(self.sent, text, final)
        if new:
            self.sent = text
        return new


# ------------------------------------------------------------------------------------------ request bodies

class _Body(BaseModel):
    # NOTE: unknown fields are errors (400 naming the field), so a parameter we do not implement (logprobs,
    # presence_penalty, ...) is refused instead of silently ignored. Strict, as OpenAI: a JSON `true` is no integer
    # (lax pydantic reads it as 1) and "yes" no boolean; ints are still floats.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value):
        # NOTE: JSON may escape a lone surrogate ("\ud800"); Python decodes it into a str that cannot be encoded
        # as UTF-8, so the tokenizer would fail (a 500). Refused in every string field, named by its own path
        # (before validation: pydantic's own error for it would name a union member). Nested bodies check their
        # own fields; free-form JSON (tool parameters) is walked where it is declared.
        return _unicode_only(value) if isinstance(value, str) else value


def _unicode_only(value):
    """`value` (a string or JSON-like value) if it holds no lone surrogate; else ValueError."""
    if (bad := _lone_surrogate(value)) is not None:
        raise ValueError(f"contains the lone surrogate U+{ord(bad):04X}, which is not a Unicode character")
    return value


# member tags of the union fields below (see the RequestValidationError handler); a content part is a TextPart or an
# ImagePart
_UNION_TAGS = {"str", "int", "TextPart", "ImagePart"}
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(value) -> str | None:
    """The first lone surrogate in a string, or in the strings (keys too) of a JSON-like value; None if none."""
    if isinstance(value, str):
        m = _SURROGATE.search(value)
        return m.group() if m else None
    items = value.items() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for item in items:
        for v in item if isinstance(value, dict) else (item,):
            if (bad := _lone_surrogate(v)) is not None:
                return bad
    return None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: str  # a data URL (data:image/png;base64,...); remote URLs are refused (the server fetches nothing)
    detail: Literal["auto", "low", "high"] | None = None  # accepted for compatibility; every image gets the spec's size


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    index: int | None = None  # present when a client rebuilt the call from stream chunks
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _structure(self) -> Message:
        if self.role != "assistant" and (self.reasoning_content is not None or self.tool_calls):
            raise ValueError(f"only assistant messages carry reasoning_content or tool_calls, not role {self.role!r}")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message of role 'tool' needs the tool_call_id it answers")
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.reasoning_content)):
            raise ValueError(f"a message of role {self.role!r} needs content")
        return self


class FunctionDef(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _json_schema_object(cls, parameters: dict | None) -> dict | None:
        """A JSON Schema of type "object" ({} = no parameters), the form K2 was trained on; only its shape is checked."""
        _unicode_only(parameters)
        if not parameters:
            return parameters
        if parameters.get("type") != "object":
            raise ValueError(f'must be a JSON Schema of "type": "object", not "type": {parameters.get("type")!r}')
        if not isinstance(parameters.get("properties", {}), dict):
            raise ValueError('"properties" must be an object mapping each parameter to its schema')
        required = parameters.get("required", [])
        if not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
            raise ValueError('"required" must be a list of parameter names')
        return parameters


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Body):
    include_usage: bool = False


class _Generate(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int = Field(1, ge=1, le=1, description="only one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    user: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # a field validator (not a model one), so that the 400 names stream_options; `stream` is declared before it.
        # NOTE: a `stream` that failed validation is not in info.data; its own error is the one to report
        if options is not None and "stream" in info.data and info.data["stream"] is not True:
            raise ValueError("only allowed when stream is true")
        return options

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None  # {"name", "schema": {...}, "strict", "description"}, as OpenAI's

    @field_validator("json_schema")
    @classmethod
    def _has_schema(cls, json_schema: dict | None) -> dict | None:
        _unicode_only(json_schema)
        if json_schema is not None and not isinstance(json_schema.get("schema"), dict):
            raise ValueError('must hold the JSON Schema as {"schema": {...}}')
        return json_schema

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is given exactly when type is "json_schema"')
        return self


Effort = Literal[chat.EFFORTS]


class ChatTemplateKwargs(_Body):
    thinking: bool | None = None
    thinking_effort: Effort | None = None


class ChatRequest(_Generate):
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal[("none", *chat.EFFORTS)] | None = None  # "none": thinking off
    chat_template_kwargs: ChatTemplateKwargs | None = None
    response_format: ResponseFormat | None = None

    def thinking(self) -> tuple[bool, str | None, str | None]:
        """(thinking on, its effort or None, the field that set the effort): from chat_template_kwargs, else
        reasoning_effort; the two must agree."""
        kw = self.chat_template_kwargs or ChatTemplateKwargs()
        effort, field = None, None
        if self.reasoning_effort not in (None, "none"):
            effort, field = self.reasoning_effort, "reasoning_effort"
        if kw.thinking_effort is not None:
            if effort is not None and effort != kw.thinking_effort:
                raise APIError(400, f"reasoning_effort={effort!r} and chat_template_kwargs.thinking_effort="
                                    f"{kw.thinking_effort!r} disagree", "chat_template_kwargs.thinking_effort")
            effort, field = kw.thinking_effort, "chat_template_kwargs.thinking_effort"
        thinking = kw.thinking if kw.thinking is not None else self.reasoning_effort != "none"
        if not thinking and (effort is not None or self.reasoning_effort not in (None, "none")):
            raise APIError(400, f"{field or 'reasoning_effort'}={effort!r} needs thinking on, but "
                                f"chat_template_kwargs.thinking is false", field or "reasoning_effort")
        if kw.thinking is True and self.reasoning_effort == "none":
            raise APIError(400, "reasoning_effort='none' turns thinking off, but chat_template_kwargs.thinking is "
                                "true", "reasoning_effort")
        return thinking, effort, field


class CompletionRequest(_Generate):
    prompt: str | list[int] = Field(min_length=1)


# ------------------------------------------------------------------------------------------ the engine thread

class EngineLoop:
    """Runs `engine.step()` on one background thread while the engine has work and hands each request's
    StepOutputs to the asyncio queue of the handler that submitted it. `stats` is a snapshot of `engine.stats()`
    taken by that thread after every step (the engine's own structures are only touched there)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.stats = engine.stats()
        self.error: BaseException | None = None
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # registration of a sink vs the thread dispatching to it
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="openk3-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], params: SamplingParams,
               cache_salt: str | None, images: list | None = None) -> tuple[Request, asyncio.Queue]:
        """Queue a request (ValueError if the engine refuses it); its outputs arrive on the returned queue, the last
        one with a finish_reason. Call from the event loop that will read the queue."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:  # the engine thread cannot dispatch this request's first output before the sink exists
            # NOTE: checked under the lock: a thread that failed after an unlocked check has already failed (and
            # cleared) every sink, and this request would wait for outputs that never come
            if self.error is not None:
                raise APIError(503, f"the engine stopped after an error: {self.error!r}", type="server_error")
            req = self.engine.submit(prompt, params, cache_salt=cache_salt, request_id=f"req-{uuid.uuid4().hex}",
                                     images=images)
            self._sinks[req.id] = (asyncio.get_running_loop(), queue)
        self._wake.set()
        return req, queue

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stopping:
            if not self.engine.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # NOTE: a dead engine thread would hang every client; fail them instead
                log.exception("engine step failed")
                self.error = e
                with self._lock:
                    for loop, queue in self._sinks.values():
                        self._deliver(loop, queue, e)
                    self._sinks.clear()
                return
            stats = self.engine.stats()
            with self._lock:
                self.stats = stats
                for out in outputs:
                    sink = self._sinks.pop(out.request_id) if out.finish_reason else self._sinks.get(out.request_id)
                    if sink is not None:
                        self._deliver(*sink, out)

    @staticmethod
    def _deliver(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item) -> None:
        if not loop.is_closed():  # the handler's loop is gone (a test client that exited): nobody is waiting
            loop.call_soon_threadsafe(queue.put_nowait, item)


# ------------------------------------------------------------------------------------------ metrics

class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

    def __init__(self, name: str, help: str):
        self.name, self.help = name, help
        self.counts = [0] * len(self.BUCKETS)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.BUCKETS):
            if value <= b:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        lines += [f'{self.name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.BUCKETS, self.counts)]
        lines += [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {self.sum:.6f}",
                  f"{self.name}_count {self.count}"]
        return lines


class Metrics:
    """Server counters, updated by the handlers (on the event loop) and rendered with the engine's stats."""

    def __init__(self):
        self.requests: dict[tuple[str, str], int] = defaultdict(int)  # (endpoint, finish reason) -> count
        self.errors: dict[int, int] = defaultdict(int)  # HTTP status -> count
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.ttft = Histogram("openk3_time_to_first_token_seconds", "Time from submission to the first token.")
        self.itl = Histogram("openk3_inter_token_latency_seconds", "Mean time between output tokens, per request.")
        self.latency = Histogram("openk3_request_latency_seconds", "Time from submission to the last token.")

    def finished(self, endpoint: str, req: Request) -> None:
        self.requests[(endpoint, req.finish_reason)] += 1
        self.prompt_tokens += len(req.prompt)
        self.completion_tokens += len(req.output)
        self.cached_tokens += req.cached_tokens
        if req.first_token_at is not None:
            self.ttft.observe(req.first_token_at - req.submitted_at)
            if len(req.output) > 1:
                self.itl.observe((req.finished_at - req.first_token_at) / (len(req.output) - 1))
        self.latency.observe(req.finished_at - req.submitted_at)

    def render(self, stats: dict) -> str:
        lines = ["# HELP openk3_requests_total Finished generation requests by endpoint and finish reason.",
                 "# TYPE openk3_requests_total counter"]
        lines += [f'openk3_requests_total{{endpoint="{e}",finish_reason="{r}"}} {n}'
                  for (e, r), n in sorted(self.requests.items())]
        lines += ["# HELP openk3_request_errors_total Requests refused, by HTTP status.",
                  "# TYPE openk3_request_errors_total counter"]
        lines += [f'openk3_request_errors_total{{status="{s}"}} {n}' for s, n in sorted(self.errors.items())]
        for name, value, help in [
                ("prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished requests."),
                ("completion_tokens_total", self.completion_tokens, "Generated tokens of finished requests."),
                ("cached_prompt_tokens_total", self.cached_tokens, "Prompt tokens served from the prefix cache.")]:
            lines += [f"# HELP openk3_{name} {help}", f"# TYPE openk3_{name} counter", f"openk3_{name} {value}"]
        hit_rate = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        gauges = [("prefix_cache_hit_rate", hit_rate, "Cached prompt tokens / prompt tokens, since start."),
                  ("queue_depth", stats["queue_depth"], "Requests submitted but not yet admitted."),
                  ("running_requests", stats["running"] + stats["prefilling"], "Requests prefilling or decoding."),
                  ("free_pages", stats["free_pages"], "Free pages in the engine's page pool.")]
        for name, value, help in gauges:
            lines += [f"# HELP openk3_{name} {help}", f"# TYPE openk3_{name} gauge", f"openk3_{name} {value}"]
        lines += ["# HELP openk3_engine Engine counters (engine.stats()).", "# TYPE openk3_engine gauge"]
        lines += [f'openk3_engine{{counter="{k}"}} {v}' for k, v in sorted(stats.items())
                  if isinstance(v, (int, float)) and not isinstance(v, bool)]
        for h in (self.ttft, self.itl, self.latency):
            lines += h.render()
        return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ the body size limit

DEFAULT_MAX_BODY_BYTES = 8 << 20  # 8 MiB: a prompt far longer than any context, still tokenised in seconds


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 (by its Content-Length, at once, or as soon as
    the bytes received pass the limit), so a huge body is never buffered, parsed or tokenised. A body within the
    limit is read here and replayed to the app, whose later receive() calls (the disconnect) pass through."""

    def __init__(self, app, max_bytes: int, refuse):
        self.app, self.max_bytes, self.refuse = app, max_bytes, refuse  # refuse(message) -> a Response

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(f"the body has {int(length)} bytes", scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self._refuse(f"the body has more than {size} bytes", scope, receive, send)
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, what: str, scope, receive, send) -> None:
        response = self.refuse(f"{what}; this server takes at most {self.max_bytes} (--max-body-bytes)")
        await response(scope, receive, send)


# ------------------------------------------------------------------------------------------ error responses

def send_error(metrics: Metrics, status: int, message: str, param: str | None = None, code: str | None = None,
               type: str = "invalid_request_error") -> JSONResponse:
    """OpenAI's error body with `status`, counted in the metrics."""
    metrics.errors[status] += 1
    return JSONResponse(error_body(message, type, param, code), status_code=status)


def validation_error(metrics: Metrics, e: RequestValidationError) -> JSONResponse:
    """A body that does not validate: 400 naming the first offending field by its path ("messages.0.content")."""
    errors = e.errors()
    # NOTE: a value in a union field gets one error per member, each ending in the member's tag ("str",
    # "list[TextPart]"); our own checks (value_error) say more than "not a str", and the tags are no field
    err = next((x for x in errors if x.get("type") == "value_error"), errors[0])
    loc = [str(p) for p in err.get("loc", ()) if p != "body" and p not in _UNION_TAGS and "[" not in str(p)]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return send_error(metrics, 400, f"the body is not valid JSON: {err.get('msg')} (at {param})", None,
                          "invalid_json")
    return send_error(metrics, 400, f"{param or 'body'}: {err.get('msg')}", param, err.get("type"))


def add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every error leaves as OpenAI's error body: ours (APIError), invalid bodies, unknown routes, and bugs (500)."""

    @app.exception_handler(APIError)
    async def _api_error(request: HTTPRequest, e: APIError) -> JSONResponse:
        return send_error(metrics, e.status, e.message, e.param, e.code, e.type)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HTTPRequest, e: RequestValidationError) -> JSONResponse:
        return validation_error(metrics, e)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: HTTPRequest, e: StarletteHTTPException) -> JSONResponse:
        return send_error(metrics, e.status_code, str(e.detail), None, None)

    @app.exception_handler(Exception)
    async def _bug(request: HTTPRequest, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return send_error(metrics, 500, f"internal error: {e!r}", None, None, "server_error")


class _ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body (`error_body`), for the OpenAPI document."""
    error: _ErrorDetail


ERROR_RESPONSES = {status: {"model": ErrorResponse, "description": description} for status, description in [
    (400, "Invalid request: a body that does not validate, or a prompt too long for the context"),
    (401, "Missing or wrong API key (when the server has one)"),
    (404, "Unknown model")]}


def openapi_without_422(app: FastAPI) -> dict:
    """FastAPI's OpenAPI document, less the 422 it adds to every route with a body: a validation error is a 400
    here, with OpenAI's error body (the RequestValidationError handler in `create_app`)."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in doc["paths"].values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            doc.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = doc
    return app.openapi_schema


def bearer_auth(api_key: str | None):
    """A FastAPI dependency: with `api_key`, the request needs `Authorization: Bearer <api_key>` (else a 401)."""

    def authorize(request: HTTPRequest) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), api_key.encode())):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                           type="authentication_error")

    return authorize


# ------------------------------------------------------------------------------------------ one request's outputs

async def disconnected(request: HTTPRequest) -> None:
    """Returns when the client has gone. NOTE: the body has been read, so the next ASGI message is the
    disconnect; waiting on it costs nothing (polling `is_disconnected` between tokens would need a timeout)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def outputs(request: HTTPRequest, req: Request, queue: asyncio.Queue, watch_disconnect: bool):
    """The request's StepOutputs as they come. Non-streaming handlers watch for a disconnect themselves, while
    waiting for every output (a streaming response is cancelled by Starlette when its client goes); either
    way the engine cancels the request at its next step."""
    done = False
    gone = asyncio.create_task(disconnected(request)) if watch_disconnect else None
    try:
        while True:
            if gone is None:
                out = await queue.get()
            elif queue.empty():
                get = asyncio.ensure_future(queue.get())
                await asyncio.wait((get, gone), return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    return
                out = get.result()
            else:
                out = queue.get_nowait()
            if isinstance(out, BaseException):
                raise APIError(500, f"the engine failed: {out!r}", type="server_error")
            if out.finish_reason == "error":  # this request failed alone; the engine serves on
                done = True
                log.error("request %s failed: %s", req.id, req.error)
                raise APIError(500, f"generation failed: {req.error}", code="generation_failed",
                               type="server_error")
            yield out
            if out.finish_reason is not None:
                done = True
                return
    finally:
        if gone is not None:
            gone.cancel()
        if not done:
            request.app.state.loop.cancel(req.id)


def cancel_if_unfinished(request: HTTPRequest, req: Request) -> BackgroundTask:
    """Runs after a streaming response ends, however it ended. NOTE: a client that leaves before the first chunk is
    pulled leaves the events generator unstarted, so the `finally` of `outputs` (which cancels) never runs; without
    this the request would decode to max_tokens holding its pages."""
    def cancel() -> None:
        if not req.finished:
            request.app.state.loop.cancel(req.id)
    return BackgroundTask(cancel)


def visible(out: StepOutput) -> list[int]:
    """The output's ids less the stop token that ended it (which the client never sees)."""
    return out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids


def usage(req: Request) -> dict:
    return {"prompt_tokens": len(req.prompt), "completion_tokens": len(req.output),
            "total_tokens": len(req.prompt) + len(req.output),
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens}}


def event(data: dict) -> str:
    """One server-sent event."""
    return "data: " + json.dumps(data) + "\n\n"


async def sse(events, metrics: Metrics):
    """Server-sent events, ending in an error event if generation fails once the stream has begun (the status
    line has gone out by then), as OpenAI's streams do."""
    try:
        async for item in events:
            yield item
    except APIError as e:
        metrics.errors[e.status] += 1
        yield event(error_body(e.message, e.type, e.param, e.code))


# ------------------------------------------------------------------------------------------ the generation routes

class Generation:
    """What the two generation routes share: the served model's name, tokenizer and context, the metrics; checks a
    request against them and submits it to the engine loop."""

    def __init__(self, tokenizer, model_name: str, max_context: int, metrics: Metrics, model_config=None):
        self.tokenizer, self.model_name, self.max_context, self.metrics = tokenizer, model_name, max_context, metrics
        # the served model's vision_config and <|media_pad|> id; None for a text-only model (images are refused)
        self.vision = model_config.vision_config if model_config is not None else None
        self.media_pad = model_config.media_placeholder_token_id if model_config is not None else None
        self.end_of_text = (tokenizer.eos_id,)
        self.chat_format = chat.chat_format_for(tokenizer)  # once per model: "xtml" or "k2"
        self.chat_stops = chat.chat_stop_ids(tokenizer)

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {self.model_name!r}", "model",
                           "model_not_found")

    def sampling(self, body: _Generate, n_prompt: int, stops: tuple[int, ...], param: str) -> SamplingParams:
        max_context = self.max_context
        room = max_context - n_prompt
        if room < 1:
            raise APIError(400, f"the prompt has {n_prompt} tokens; the context holds {max_context}, leaving no room "
                                f"to generate", param, "context_length_exceeded")
        requested = body.requested_max_tokens
        if requested is not None and requested > room:
            raise APIError(400, f"max_tokens={requested} + the prompt's {n_prompt} tokens exceed the context of "
                                f"{max_context} tokens (at most {room} can be generated)", "max_tokens",
                           "context_length_exceeded")
        return SamplingParams(max_tokens=requested or min(room, DEFAULT_MAX_TOKENS), temperature=body.temperature,
                              top_p=body.top_p, top_k=body.top_k, seed=body.seed, stop_token_ids=stops)

    @staticmethod
    def submit(request: HTTPRequest, prompt: list[int], params: SamplingParams, salt: str | None,
               param: str, images: list | None = None) -> tuple[Request, asyncio.Queue]:
        try:  # NOTE: the engine validates what only it knows (vocabulary, page pool); its ValueError is the client's
            return request.app.state.loop.submit(prompt, params, salt, images)
        except ValueError as e:
            raise APIError(400, str(e), param, "invalid_prompt") from None


def request_images(gen: Generation, messages: list[dict]) -> list:
    """Decode and preprocess every image part of `messages` (in prompt order), replacing each by the part chat.py
    renders (its original width and height). A bad image, a remote URL or an image for a text-only model is a 400
    naming the part."""
    images, tokens = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m.get("content"), list):
            continue
        for j, part in enumerate(m["content"]):
            if part.get("type") != "image_url":
                continue
            where = f"messages.{i}.content.{j}.image_url"
            if gen.vision is None:
                raise APIError(400, f"{where}: model {gen.model_name!r} has no vision tower and takes no images", where,
                               "images_not_supported")
            if m["role"] == "tool":
                # NOTE: chat.py re-orders a run of tool messages into the calls' order, which would mismatch the
                # images' order; so tool results carry text only
                raise APIError(400, f"{where}: images are accepted in system and user messages, not tool results",
                               where, "invalid_image")
            try:
                image = decode_image(decode_data_url(part["image_url"]["url"], where), where)
                # NOTE: counted before preprocessing, which holds each image as fp32 patches (up to ~150 MB): an
                # 8 MiB body fits dozens of small PNGs of 8192^2 pixels, whose prompt the context check would only
                # refuse after all of them were in memory
                # each image's prompt is its slots plus at least 4 ids (begin, content, end and one for "image WxH"),
                # so thousands of 1x1 images are bounded by the context too
                tokens += num_image_tokens(*image.size, gen.vision) + 4
                if tokens > gen.max_context:
                    raise APIError(400, f"{where}: the images up to this one need {tokens} vision tokens, more than "
                                        f"the context holds ({gen.max_context})", where, "invalid_image")
                item = preprocess(image, gen.vision)
            except ImageError as e:
                raise APIError(400, str(e), where, "invalid_image") from None
            images.append(item)
            m["content"][j] = {"type": "image_url", "width": item.width, "height": item.height}
    return images


def render_request(gen: Generation, body: ChatRequest) -> tuple[list[int], dict, list]:
    """The request's prompt ids (chat.render + encode_segments in the model's format; each image's slot written
    once per vision vector), the parser's options and the preprocessed images. chat.py's ValueError (naming the
    message index or the option) is the client's: a 400 naming that field."""
    thinking, effort, effort_field = body.thinking()
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    tool_choice = body.tool_choice
    response_format = body.response_format.model_dump(exclude_none=True) if body.response_format else None
    if response_format is not None and response_format["type"] == "text":
        response_format = None
    if gen.chat_format == "k2" and tool_choice == "none":
        tools, tool_choice = None, None  # K2 has no tool-choice message: undeclared tools are not called
    options = dict(tools=tools, tool_choice=tool_choice, response_format=response_format)
    if gen.chat_format == "xtml" or not thinking or effort is not None:  # K2 refuses both: a 400 naming them
        options.update(thinking=thinking, effort=effort)
    messages = [m.model_dump(exclude_none=True, exclude={"tool_calls": {"__all__": {"index"}}}) for m in body.messages]
    images = request_images(gen, messages)
    try:
        prompt = chat.encode_segments(gen.tokenizer, chat.render(gen.chat_format, messages, **options))
    except ValueError as e:
        thinking_field = "reasoning_effort" if body.reasoning_effort == "none" else "chat_template_kwargs.thinking"
        raise APIError(400, f"{e} (this model speaks the {gen.chat_format} chat format)",
                       _field_of(str(e), effort_field, thinking_field), "invalid_request") from None
    declared = bool(tools) and tool_choice != "none"
    if images:
        prompt = expand_media_pads(prompt, gen.media_pad, [im.num_tokens for im in images])
    return prompt, dict(thinking=thinking, tools_declared=declared), images


_MESSAGE_INDEX = re.compile(r"^message (\d+)")


def _field_of(message: str, effort_field: str | None, thinking_field: str) -> str:
    """The request field a chat.py error names."""
    if m := _MESSAGE_INDEX.match(message):
        return f"messages.{m[1]}"
    for key in ("tool_choice", "response_format", "tools"):
        if key in message:
            return key
    if "effort" in message:
        return effort_field or "reasoning_effort"
    if "thinking" in message:
        return thinking_field
    return "messages"


def chat_finish(req: Request, n_calls: int) -> str:
    return "tool_calls" if req.finish_reason == "stop" and n_calls else req.finish_reason


async def chat_completion(gen: Generation, body: ChatRequest, request: HTTPRequest) -> Response:
    """POST /v1/chat/completions: the conversation rendered in the model's chat format, the output parsed back into
    reasoning, content and tool calls; one JSON body, or chunks of differences as server-sent events."""
    gen.check_model(body.model)
    tokenizer, model_name, metrics = gen.tokenizer, gen.model_name, gen.metrics
    # NOTE: rendering and tokenising a long conversation takes seconds: off the event loop, so that every other
    # client (and /health) is answered meanwhile
    prompt, parse_options, images = await run_in_threadpool(render_request, gen, body)
    params = gen.sampling(body, len(prompt), gen.chat_stops, "messages")
    req, queue = gen.submit(request, prompt, params, body.cache_salt, "messages", images or None)
    rid, created = f"chatcmpl-{req.id[4:]}", int(time.time())
    parser = chat.IdOutputParser(tokenizer, gen.chat_format, **parse_options)

    def chunk(delta: dict, finish: str | None = None) -> str:
        return event({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                      "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})

    if not body.stream:
        parsed = chat.ParsedOutput()
        async for out in outputs(request, req, queue, watch_disconnect=True):
            parsed += parser.feed(visible(out))
        if not req.finished:  # the client left
            return Response(status_code=499)
        parsed += parser.finish()
        metrics.finished("chat", req)
        message = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning_content:
            message["reasoning_content"] = parsed.reasoning_content
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                             "choices": [{"index": 0, "message": message, "logprobs": None,
                                          "finish_reason": chat_finish(req, len(parsed.tool_calls))}],
                             "usage": usage(req)})

    async def events():
        n_calls = 0

        def delta_of(parsed: chat.ParsedOutput) -> dict:
            nonlocal n_calls
            delta = {}
            if parsed.reasoning_content:
                delta["reasoning_content"] = parsed.reasoning_content
            if parsed.content:
                delta["content"] = parsed.content
            if parsed.tool_calls:  # each call whole, once complete, with its index (as OpenAI's deltas carry)
                delta["tool_calls"] = [dict(c, index=n_calls + i) for i, c in enumerate(parsed.tool_calls)]
                n_calls += len(parsed.tool_calls)
            return delta

        yield chunk({"role": "assistant", "content": ""})
        async for out in outputs(request, req, queue, watch_disconnect=False):
            parsed = parser.feed(visible(out))
            if out.finish_reason is not None:
                parsed += parser.finish()
            if delta := delta_of(parsed):
                yield chunk(delta)
        metrics.finished("chat", req)
        yield chunk({}, chat_finish(req, n_calls))
        if body.stream_options is not None and body.stream_options.include_usage:
            yield event({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                         "choices": [], "usage": usage(req)})
        yield "data: [DONE]\n\n"

    return StreamingResponse(sse(events(), metrics), media_type="text/event-stream",
                             background=cancel_if_unfinished(request, req))


async def completion(gen: Generation, body: CompletionRequest, request: HTTPRequest) -> Response:
    """POST /v1/completions: a text prompt (after [BOS], as `openk3 generate`) or a list of ids taken as it is;
    the decoded text as one JSON body, or its differences as server-sent events."""
    gen.check_model(body.model)
    tokenizer, model_name, metrics = gen.tokenizer, gen.model_name, gen.metrics
    if isinstance(body.prompt, str):  # NOTE: off the event loop, as in chat_completion
        prompt = [tokenizer.bos_id] + await run_in_threadpool(tokenizer.encode, body.prompt)
    else:
        prompt = body.prompt
    params = gen.sampling(body, len(prompt), gen.end_of_text, "prompt")
    req, queue = gen.submit(request, prompt, params, body.cache_salt, "prompt")
    rid, created = f"cmpl-{req.id[4:]}", int(time.time())

    def body_of(text: str, finish: str | None, with_usage: bool) -> dict:
        out = {"id": rid, "object": "text_completion", "created": created, "model": model_name,
               "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
        return dict(out, usage=usage(req)) if with_usage else out

    if not body.stream:
        ids = []
        async for out in outputs(request, req, queue, watch_disconnect=True):
            ids += visible(out)
        if not req.finished:
            return Response(status_code=499)
        metrics.finished("completions", req)
        return JSONResponse(body_of(tokenizer.decode(ids, skip_special=True), req.finish_reason, True))

    async def events():
        ids, diff = [], TextDiff()
        async for out in outputs(request, req, queue, watch_disconnect=False):
            ids += visible(out)
            new = diff.update(tokenizer.decode(ids, skip_special=True), out.finish_reason is not None)
            if new:
                yield event(body_of(new, None, False))
        metrics.finished("completions", req)
        yield event(body_of("", req.finish_reason, False))
        if body.stream_options is not None and body.stream_options.include_usage:
            yield event(dict(body_of("", None, True), choices=[]))
        yield "data: [DONE]\n\n"

    return StreamingResponse(sse(events(), metrics), media_type="text/event-stream",
                             background=cancel_if_unfinished(request, req))


# ------------------------------------------------------------------------------------------ the app

def create_app(engine: Engine, tokenizer, model_name: str, api_key: str | None = None,
               max_context: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app serving `engine`. `max_context`: the most tokens (prompt + max_tokens) one request may use
    (default: the model's max_position_embeddings); a longer prompt is refused after tokenisation, whose cost
    `max_body_bytes` bounds (a larger body is a 413). With `api_key`, /v1 routes and /metrics need
    `Authorization: Bearer <api_key>`. The engine thread runs between the app's startup and shutdown (lifespan)."""
    api_key = api_key or None  # NOTE: OPENK3_API_KEY="" means no key (as the banner says), not "send the empty key"
    positions = engine.model.config.max_position_embeddings
    if max_context is not None and max_context > positions:
        raise ValueError(f"max_context={max_context} (--max-context) exceeds the model's "
                         f"max_position_embeddings={positions}")
    metrics = Metrics()
    gen = Generation(tokenizer, model_name, max_context or positions, metrics, engine.model.config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.loop = EngineLoop(engine)
        yield
        app.state.loop.stop()

    app = FastAPI(title="openk3", lifespan=lifespan)
    app.openapi = lambda: openapi_without_422(app)
    app.state.metrics = metrics
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes,
                       refuse=lambda message: send_error(metrics, 413, message, None, "request_too_large"))
    add_error_handlers(app, metrics)
    authorized = [Depends(bearer_auth(api_key))]

    @app.get("/health")
    async def health(request: HTTPRequest) -> JSONResponse:
        loop = request.app.state.loop
        if loop.error is not None:
            return send_error(metrics, 503, f"the engine stopped after an error: {loop.error!r}", type="server_error")
        return JSONResponse({"status": "ok", "model": model_name})

    @app.get("/metrics", dependencies=authorized)
    async def get_metrics(request: HTTPRequest) -> PlainTextResponse:
        return PlainTextResponse(metrics.render(request.app.state.loop.stats),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "openk3"}]}

    @app.post("/v1/chat/completions", dependencies=authorized, responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatRequest, request: HTTPRequest) -> Response:
        return await chat_completion(gen, body, request)

    @app.post("/v1/completions", dependencies=authorized, responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: HTTPRequest) -> Response:
        return await completion(gen, body, request)

    return app


# ------------------------------------------------------------------------------------------ running it

class Server:
    """Runs an app under uvicorn on a background thread (for tests, benchmarks and notebooks). Binds `host`
    (127.0.0.1 by default) on `port` (0 = a free port, read back from the socket). While it runs,
    `server.app.state.loop.stats` is the engine's latest stats snapshot."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.app, self.host, self.port = app, host, self.sock.getsockname()[1]
        self.uvicorn = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]},
                                       name="openk3-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> Server:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server on {self.url} did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful: stop accepting connections, let in-flight requests finish, then stop the engine thread."""
        self.uvicorn.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise RuntimeError(f"the server on {self.url} did not stop within {timeout} s")
        self.sock.close()


def register_commands(sub: argparse._SubParsersAction) -> None:
    """Register `serve` on an argparse sub-parser set (its one-line help is in openk3/cli.py)."""
    p = sub.add_parser("serve")
    p.add_argument("--model", required=True, help="model directory or run directory (its latest checkpoint)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("OPENK3_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $OPENK3_API_KEY; none = open)")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: the --model directory's name)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-batch", type=int, default=32, help="requests prefilling or decoding at once")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--cache-tokens", type=int, default=65536, help="size of the page pool, in tokens")
    add_compile_arg(p)
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body accepted; larger gets 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    add_threads_arg(p)
    p.add_argument("--max-context", type=int, default=None,
                   help="most tokens (prompt + max_tokens) per request (default: max_position_embeddings)")
    p.set_defaults(fn=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> None:
    if args.cache_tokens < args.page_size:
        raise ValueError(f"--cache-tokens={args.cache_tokens} is smaller than one page (--page-size={args.page_size})")
    set_threads(args.threads)
    model, tokenizer, _ = load_for_inference(args.model, args.device)
    config = EngineConfig(page_size=args.page_size, num_pages=args.cache_tokens // args.page_size + 1,
                          max_batch=args.max_batch, **compile_settings(args))
    name = args.served_model_name or Path(args.model).resolve().name  # the directory the user named, e.g. a run
    app = create_app(Engine(model, config), tokenizer, name, api_key=args.api_key, max_context=args.max_context,
                     max_body_bytes=args.max_body_bytes)
    key = " (API key required)" if args.api_key else ""
    print(f"openk3 serve: {name} on http://{args.host}:{args.port}/v1{key}")
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
