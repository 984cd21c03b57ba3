"""The OpenAI-compatible HTTP layer (`recguide serve`): FastAPI routes over an `EngineWorker`.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both with SSE streaming), `GET /v1/models`,
`GET /health`, `GET /metrics` (Prometheus). HTTP knows nothing of decoding: it turns a request into prompt ids,
a token budget and a sampling setting, submits them to the worker, and turns the worker's per-round token bursts
into text chunks. Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad
request, 401 for a missing or wrong API key, 404 for an unknown model, 411 / 413 for a body without a length or
over the limit, 429 when
too many streams are open, 503 when the queue is full or the decoding thread has stopped; never a 500 for a
user's input.

Why not transformers' own `transformers serve` app: its model manager resolves `config.architectures[0]` inside
the transformers namespace, so it cannot load a remote-code model, and its internals were rewritten in 5.25 (the
generate managers, the streamer and `build_server`'s signature changed), so a manager written for 5.24 would
not survive the supported range. The schemas here follow OpenAI's API, as `transformers serve` and vLLM do.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..core.engine import Emission
from .worker import EngineWorker, Overloaded, Sampling


@dataclass
class ServerLimits:
    """HTTP-side bounds (the worker bounds prompts, max_tokens and its queue)."""

    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer <key>`
    max_body_bytes: int = 1 << 20  # a request body larger than this gets 413
    max_open_streams: int = 64  # streaming responses open at once; one more gets 429


# ---------------------------------------------------------------- OpenAI's request schemas (what we honour)
class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # other OpenAI fields (user, seed, penalties...) are accepted, unused

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]  # OpenAI's four forms; one prompt per request
    echo: Literal[False] = False
    logprobs: None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: Literal[False] | None = None


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


# ---------------------------------------------------------------- text from token bursts
class TextAssembler:
    """Token ids in, text deltas out: holds back an unfinished UTF-8 character or the start of a stop string, and
    cuts the text at the first stop string."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = 0  # characters handed out
        self.stopped = False  # a stop string was found

    def add(self, new_ids: list[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, self.stopped, final = text[:cut], True, True
        end = len(text) if final else len(text) - self._held(text)
        delta, self.sent = text[self.sent:end], max(self.sent, end)
        return delta

    def _held(self, text: str) -> int:
        held = 1 if text.endswith("\ufffd") else 0  # a character whose bytes are not all decoded yet
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    held = max(held, k)
                    break
        return held


class Guard:
    """ASGI middleware: /v1/* needs the API key (when set) and a Content-Length within the limit, checked before
    the body is read or anything runs. (Plain ASGI, not Starlette's `BaseHTTPMiddleware`, which hides a client's
    disconnect from the route: a non-streaming request whose client left would decode on to its end.)"""

    def __init__(self, app, limits: ServerLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                return await refusal.response()(scope, receive, send)
        await self.app(scope, receive, send)

    def refusal(self, scope) -> APIError | None:
        path = scope["path"][len(scope.get("root_path", "")):]  # under a route prefix too (Ray Serve's)
        if not path.startswith("/v1/"):
            return None
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        lim = self.limits
        if lim.api_key is not None:
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {lim.api_key}".encode()):
                return APIError(401, "missing or wrong API key (Authorization: Bearer <key>)", code="invalid_api_key")
        size = headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > lim.max_body_bytes):
            return APIError(413, f"request body over {lim.max_body_bytes} bytes", code="request_too_large")
        if size is None and scope["method"] == "POST":  # a chunked body: its size is unknown until read
            return APIError(411, "send the body with a Content-Length header", code="length_required")
        return None


class NameReplica:
    """ASGI middleware: every response names the Ray Serve replica that made it (`x-recguide-replica`)."""

    def __init__(self, app, replica_id: str):
        self.app, self.header = app, (b"x-recguide-replica", replica_id.encode())

    async def __call__(self, scope, receive, send):
        async def named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named if scope["type"] == "http" else send)


def build_app(worker: EngineWorker, tokenizer, model_name: str, limits: ServerLimits | None = None,
              replica: tuple[str, int] | None = None) -> FastAPI:
    """The FastAPI app serving `worker`'s model as `model_name`. `replica`: (id, process id) of a Ray Serve
    replica (`ray_serve.py`): every response then names it in `x-recguide-replica`, and /metrics reports it."""
    limits = limits or ServerLimits()
    app = FastAPI(title="recguide-hf", docs_url=None, redoc_url=None)
    state = {"open_streams": 0}
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        if first.get("type") == "json_invalid":
            return APIError(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'decode error')})"
                            ).response()
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return APIError(400, message, param=where).response()

    app.add_middleware(Guard, limits=limits)
    if replica is not None:  # added last: outermost, so the guard's refusals are named too
        app.add_middleware(NameReplica, replica_id=replica[0])

    @app.get("/health")
    async def health():
        if not worker.alive:
            return APIError(503, "the decoding thread has stopped", "server_error", code="engine_dead").response()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        running, waiting = worker.counts()
        text = worker.metrics.render(running, waiting, state["open_streams"], worker.limits.slots)
        if replica is not None:
            text += ("# HELP recguide_replica_info The Ray Serve replica that answered (id, process id).\n"
                     "# TYPE recguide_replica_info gauge\n"
                     f'recguide_replica_info{{replica="{replica[0]}",pid="{replica[1]}"}} 1\n')
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "recguide-hf"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):  # a batch of prompts
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request (a list of prompts is not supported)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = tokenizer(prompt)["input_ids"]
        else:
            ids = list(prompt)
            if 0 < len(ids) <= worker.limits.max_prompt_tokens and any(not 0 <= t < len(tokenizer) for t in ids):
                raise APIError(400, "prompt token ids outside the vocabulary", param="prompt")
        return await respond(body, request, ids, body.max_tokens or 16, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        check_model(body.model)
        if getattr(tokenizer, "chat_template", None) is None:
            raise APIError(400, f"{model_name} has no chat template; use /v1/completions", param="messages",
                           code="no_chat_template")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        max_tokens = body.max_completion_tokens or body.max_tokens or worker.limits.max_new_tokens
        return await respond(body, request, list(ids), max_tokens, "chat.completion")

    def check_model(name: str):
        if name != model_name:
            raise APIError(404, f"model {name!r} not found; this server has {model_name!r}", param="model",
                           code="model_not_found")

    async def respond(body: _Body, request: Request, ids: list[int], max_tokens: int, kind: str):
        if len(ids) > worker.limits.max_prompt_tokens or not ids:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this server takes 1 to "
                           f"{worker.limits.max_prompt_tokens}", param="prompt", code="context_length_exceeded")
        if max_tokens > worker.limits.max_new_tokens:
            raise APIError(400, f"max_tokens must be at most {worker.limits.max_new_tokens}, got {max_tokens}",
                           param="max_tokens")
        if body.stream and state["open_streams"] >= limits.max_open_streams:
            raise APIError(429, f"{state['open_streams']} streams are open, the most this server keeps",
                           "rate_limit_error", code="too_many_streams")
        default = worker.default_sampling  # what the model's generation config does (the bundled one: greedy)
        temperature = body.temperature if body.temperature is not None else default.temperature
        top_p = body.top_p if body.top_p is not None else default.top_p
        sampling = Sampling(temperature, top_p if temperature > 0 else 1.0)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Emission] = asyncio.Queue()
        try:
            rid = worker.submit(ids, max_tokens, lambda e: loop.call_soon_threadsafe(events.put_nowait, e),
                                sampling)
        except Overloaded as err:
            raise APIError(503, str(err), "server_error", code="overloaded") from None
        except ValueError as err:
            raise APIError(400, str(err)) from None
        reply = Reply(kind, model_name, tokenizer, body.stops(), len(ids), max_tokens, worker.eos_ids)
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return ClosingStream(stream(reply, rid, events, include_usage), lambda: worker.cancel(rid),
                                 media_type="text/event-stream")
        return await whole(reply, rid, events, request)

    async def stream(reply: Reply, rid, events: asyncio.Queue, include_usage: bool):
        state["open_streams"] += 1
        done = False
        try:
            if reply.kind == "chat.completion":  # the role first, as OpenAI's chat streams do
                yield sse(reply.chunk("", None, first=True))
            while not done:
                e = await events.get()
                done = e.finished
                if e.stats and "error" in e.stats:
                    yield sse({"error": {"message": "decoding failed: " + e.stats["error"], "type": "server_error",
                                         "param": None, "code": "engine_error"}})
                    break
                delta = reply.add(e.new_ids, e.finished)
                if reply.text.stopped and not done:  # a stop string ended it: free the row now
                    worker.cancel(rid)
                    done = True
                if delta:
                    yield sse(reply.chunk(delta, None))
                if done:
                    yield sse(reply.chunk("", reply.finish_reason()))
            if include_usage:
                yield sse({**reply.chunk("", None), "choices": [], "usage": reply.usage()})
            yield "data: [DONE]\n\n"
        finally:
            state["open_streams"] -= 1
            if not done:  # the client left (or the server is stopping): free its row at the next round
                worker.cancel(rid)

    async def whole(reply: Reply, rid, events: asyncio.Queue, request: Request):
        async def left():
            while not await request.is_disconnected():
                await asyncio.sleep(0.25)

        watch = asyncio.ensure_future(left())
        finished = False
        try:
            while True:
                get = asyncio.ensure_future(events.get())
                ready, _ = await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
                if watch in ready:
                    get.cancel()
                    worker.cancel(rid)
                    return JSONResponse({}, status_code=499)
                e = get.result()
                if e.stats and "error" in e.stats:
                    raise APIError(503, "decoding failed: " + e.stats["error"], "server_error", code="engine_error")
                reply.add(e.new_ids, e.finished)
                if reply.text.stopped and not e.finished:
                    worker.cancel(rid)
                if e.finished or reply.text.stopped:
                    finished = True
                    return reply.whole()
        finally:
            watch.cancel()
            if not finished:  # the client left, or the task was cancelled (Serve's proxy cancels it when its
                worker.cancel(rid)  # client disconnects): the row is free at the next round

    return app


class ClosingStream(StreamingResponse):
    """A streaming response that always closes its generator (Starlette leaves a generator interrupted at a
    `yield` to the garbage collector) and then calls `on_close` (freeing the request's row; a finished request's
    cancel is a no-op), even when the response was cancelled before its generator started."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._content, self._on_close = content, on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._content.aclose()
            self._on_close()


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class Reply:
    """One response's id, text and counts, in the completions or chat shape."""

    def __init__(self, kind: str, model: str, tokenizer, stops: list[str], prompt_tokens: int, max_tokens: int,
                 eos_ids: list[int]):
        self.kind, self.model, self.prompt_tokens, self.max_tokens = kind, model, prompt_tokens, max_tokens
        self.id = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text = TextAssembler(tokenizer, stops)
        self.content = ""
        self.eos_ids = set(eos_ids)

    def add(self, new_ids: list[int], final: bool) -> str:
        delta = self.text.add(new_ids, final)
        self.content += delta
        return delta

    def finish_reason(self) -> str:
        ids = self.text.ids
        if self.text.stopped or (ids and ids[-1] in self.eos_ids):
            return "stop"
        return "length" if len(ids) >= self.max_tokens else "stop"

    def usage(self) -> dict:
        n = len(self.text.ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    def chunk(self, delta: str, finish_reason: str | None, first: bool = False) -> dict:
        if self.kind == "chat.completion":
            d = {"role": "assistant", "content": delta} if first else ({"content": delta} if delta else {})
            choice = {"index": 0, "delta": d, "finish_reason": finish_reason, "logprobs": None}
            return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": [choice]}
        choice = {"index": 0, "text": delta, "finish_reason": finish_reason, "logprobs": None}
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choice]}

    def whole(self) -> dict:
        if self.kind == "chat.completion":
            choice = {"index": 0, "message": {"role": "assistant", "content": self.content},
                      "finish_reason": self.finish_reason(), "logprobs": None}
        else:
            choice = {"index": 0, "text": self.content, "finish_reason": self.finish_reason(), "logprobs": None}
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage()}
