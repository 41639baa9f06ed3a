"""The HTTP API: OpenAI's chat and completions endpoints (JSON or server-sent events), models, health, Prometheus
metrics, and the context-cache API (POST/GET/DELETE /v1/caches)."""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from kvreuse.engine.generate import Generation
from kvreuse.engine.sampling import TokenLogprob
from kvreuse.server.errors import install_handlers
from kvreuse.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from kvreuse.server.middleware import BodyLimit, RequestMetrics, RequireAPIKey, set_outcome
from kvreuse.server.protocol import (
    AssistantMessage,
    CacheCreateRequest,
    CacheDeleted,
    CacheInfo,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    GenerationParams,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from kvreuse.server.service import EngineService, JobStream, Prepared, error_of, usage_of

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 408, 413, 429, 503)
}
CLIENT_GONE = 499  # nginx's status for a client that closed the connection before the response ended
SHUTDOWN_MARGIN_SECONDS = 0.5  # what streams ended at shutdown get to send their error event and [DONE]
# endpoint -> (id prefix, response type, the choice (index, finished generation, echoed prompt) of a response)
ENDPOINTS = {
    "chat": ("chatcmpl", ChatCompletionResponse, lambda index, result, texts, _: ChatChoice(
        index=index, message=AssistantMessage(content=result.text), finish_reason=result.finish_reason,
        stop_reason=result.stop_reason,
        logprobs=None if result.logprobs is None else chat_logprobs(result.logprobs, texts))),
    "completions": ("cmpl", CompletionResponse, lambda index, result, texts, echo: CompletionChoice(
        index=index, text=echo + result.text, finish_reason=result.finish_reason, stop_reason=result.stop_reason,
        logprobs=None if result.logprobs is None else completion_logprobs(result.logprobs, texts, 0))),
}
SALT_QUERY = Query(None, min_length=1, description="the tenant the cache was created for")


def sse(data: str) -> str:
    return f"data: {data}\n\n"


class Chunker:
    """Builds one endpoint's stream chunks (chat deltas or completion texts) under one id, each of one choice."""

    def __init__(self, chat: bool, id_: str, model: str, include_usage: bool, texts: TokenTexts,
                 choices_per_prompt: int = 1, echo: list[str] | None = None):
        self.chat, self.id, self.model, self.include_usage, self.texts = chat, id_, model, include_usage, texts
        self.choices_per_prompt = choices_per_prompt
        self.echo = echo  # a completion's prompts, each sent before its choices' text
        self.created = int(time.time())
        # each choice's text of the tokens sent so far: the completions form's offsets go on from it
        self._token_characters: dict[int, int] = {}

    def _chunk(self, choices: list, usage=None) -> str:
        kind = ChatCompletionChunk if self.chat else CompletionResponse
        chunk = kind(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)
        return sse(chunk.model_dump_json(exclude=None if self.include_usage else {"usage"}))

    def text(self, choice: int, text: str, role: bool = False, logprobs: list[TokenLogprob] | None = None) -> str:
        if self.chat:
            delta = DeltaMessage(role="assistant" if role else None, content=text)
            form = chat_logprobs(logprobs, self.texts) if logprobs else None
            return self._chunk([ChatChunkChoice(index=choice, delta=delta, logprobs=form)])
        offset = self._token_characters.get(choice, 0)
        form = completion_logprobs(logprobs, self.texts, offset) if logprobs else None
        if form is not None:
            self._token_characters[choice] = form.text_offset[-1] + len(form.tokens[-1])
        return self._chunk([CompletionChoice(index=choice, text=text, logprobs=form)])

    def opening(self, choice: int) -> str | None:
        """What a choice's stream starts with, before its first token: a chat's role (as vLLM sends it), a
        completion's echoed prompt."""
        if self.chat:
            return self.text(choice, "", role=True)
        return self.text(choice, self.echo[choice // self.choices_per_prompt]) if self.echo else None

    def finish(self, choice: int, result: Generation) -> str:
        """A choice's last chunk: how its generation ended, no text."""
        ended = dict(index=choice, finish_reason=result.finish_reason, stop_reason=result.stop_reason)
        if self.chat:
            return self._chunk([ChatChunkChoice(delta=DeltaMessage(), **ended)])
        return self._chunk([CompletionChoice(text="", **ended)])

    def usage(self, results: list[Generation]) -> str:
        return self._chunk([], usage_of(results, self.choices_per_prompt))


async def event_stream(stream: JobStream, raw: Request, chunker: Chunker, service: EngineService
                       ) -> AsyncIterator[str]:
    """The job's events as server-sent events. Its 200 header is sent before the end is known: how it really
    ended (an error event, a client gone mid-stream) is recorded for the request metrics."""
    started: set[int] = set()  # the choices whose first chunk was sent
    results: dict[int, Generation] = {}
    ended = False
    try:
        async for event in stream.events(raw.is_disconnected):
            if event.choice not in started and not event.error and (opening := chunker.opening(event.choice)):
                yield opening
            started.add(event.choice)
            if event.text or event.logprobs:
                yield chunker.text(event.choice, event.text, logprobs=event.logprobs)
            if event.error:
                error = error_of(event.error)
                set_outcome(raw.scope, error.status)
                ended = True
                yield sse(error.body.model_dump_json())
            if event.result:
                results[event.choice] = event.result
                yield chunker.finish(event.choice, event.result)
            if len(results) == stream.choices:
                finished = [results[choice] for choice in range(stream.choices)]
                service.metrics.generated(finished, chunker.choices_per_prompt)
                ended = True
                if chunker.include_usage:
                    yield chunker.usage(finished)
        yield "data: [DONE]\n\n"
    finally:
        if not ended:  # the client went away before the end
            set_outcome(raw.scope, CLIENT_GONE)


async def wait_for_results(stream: JobStream, raw: Request, service: EngineService, choices_per_prompt: int
                           ) -> list[Generation]:
    results = await stream.results(raw.is_disconnected)
    service.metrics.generated(results, choices_per_prompt)
    return results


def streaming(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class HiddenSalts(logging.Filter):
    """uvicorn's access log shows each request's path with its query, where the context-cache API takes its
    tenant's cache_salt: the one key to that tenant's caches, hidden there."""

    SALT = re.compile(r"(cache_salt=)[^&\s]*")

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) > 2 and isinstance(args[2], str):  # uvicorn's: client, method, path
            record.args = (*args[:2], self.SALT.sub(r"\1***", args[2]), *args[3:])
        return True


class GracefulServer(uvicorn.Server):
    """uvicorn cancels what still runs at its graceful-shutdown timeout, cutting streams mid-chunk: the engine
    ends those requests a little before, with an error their clients can read. Its access log hides tenants'
    salts."""

    def __init__(self, config: uvicorn.Config, service: EngineService) -> None:
        super().__init__(config)
        self.service = service
        access = logging.getLogger("uvicorn.access")
        if not any(isinstance(f, HiddenSalts) for f in access.filters):
            access.addFilter(HiddenSalts())

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            timeout = self.config.timeout_graceful_shutdown or 0.0
            self.service.begin_shutdown(max(0.0, timeout - SHUTDOWN_MARGIN_SECONDS))
        super().handle_exit(sig, frame)


def create_app(service: EngineService) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        service.start()
        yield
        service.close()

    app = FastAPI(title="kvreuse", summary="OpenAI-compatible serving with reusable documents", lifespan=lifespan)
    install_handlers(app)
    # the last added runs first: answer a browser's preflight, count every request, then check its key, then cap
    # its body (a preflight carries no key: it must be answered before the key is asked for)
    app.add_middleware(BodyLimit, max_bytes=service.config.max_request_bytes)
    app.add_middleware(RequireAPIKey, api_key=service.config.api_key)
    app.add_middleware(RequestMetrics, metrics=service.metrics)
    if service.config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=service.config.allowed_origins,  # client libraries send
                           allow_methods=["GET", "POST", "DELETE"], allow_headers=["*"])  # headers of their own

    v1 = APIRouter(prefix="/v1", responses=ERRORS)

    async def answer(body: GenerationParams, prepare: Callable[..., Awaitable[list[Prepared]]], raw: Request,
                     endpoint: str):
        model = service.check_model(body.model)
        prepared = await prepare(body)
        echo = [await service.echoed_prompt(prompt) for prompt in body.prompts] \
            if isinstance(body, CompletionRequest) and body.echo else None
        stream = service.submit(prepared)
        id_prefix, response_type, choice_of = ENDPOINTS[endpoint]
        id_ = f"{id_prefix}-{uuid.uuid4().hex}"
        if body.stream:
            chunker = Chunker(endpoint == "chat", id_, model, body.include_usage, service.token_texts, body.n, echo)
            return streaming(event_stream(stream, raw, chunker, service))
        results = await wait_for_results(stream, raw, service, body.n)
        choices = [choice_of(index, result, service.token_texts, echo[index // body.n] if echo else "")
                   for index, result in enumerate(results)]
        return response_type(id=id_, created=int(time.time()), model=model, choices=choices,
                             usage=usage_of(results, body.n))

    @v1.post("/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await answer(body, service.prepare_chat, raw, "chat")

    @v1.post("/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest, raw: Request):
        return await answer(body, service.prepare_completion, raw, "completions")

    @v1.get("/models", response_model=ModelList)
    async def models() -> ModelList:
        root = str(service.engine.loaded.path)
        return ModelList(data=[ModelCard(id=name, created=service.created, root=root,
                                         max_model_len=service.max_model_len) for name in service.model_names])

    @v1.post("/caches", response_model=CacheInfo)
    async def create_cache(body: CacheCreateRequest, raw: Request) -> CacheInfo:
        return await service.create_cache(body, raw.is_disconnected)

    @v1.get("/caches/{cache_id}", response_model=CacheInfo)
    async def get_cache(cache_id: str, cache_salt: str | None = SALT_QUERY) -> CacheInfo:
        return await service.cache_info(service.find_cache(cache_id, cache_salt))

    @v1.delete("/caches/{cache_id}", response_model=CacheDeleted)
    async def delete_cache(cache_id: str, cache_salt: str | None = SALT_QUERY) -> CacheDeleted:
        await service.delete_cache(cache_id, cache_salt)
        return CacheDeleted(id=cache_id)

    app.include_router(v1)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(body: TokenizeChatRequest | TokenizeCompletionRequest) -> TokenizeResponse:
        """vLLM's: the token ids of the prompt a chat or completion request of this body would run, documents and
        cached ones included, so a client can fit its documents to the window."""
        service.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            prompt = await service.chat_prompt(body)
        else:
            (prompt,) = await service.completion_prompts(body, [body.prompt])
        return TokenizeResponse(count=len(prompt), max_model_len=service.max_model_len,
                                tokens=prompt.token_ids.tolist())

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        service.check_model(body.model)
        return DetokenizeResponse(prompt=await service.detokenize(body.tokens))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "running": service.scheduler.running, "waiting": service.scheduler.waiting}

    @app.head("/health", include_in_schema=False)  # load balancers probe with HEAD too
    async def health_probe() -> Response:
        return Response()

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
