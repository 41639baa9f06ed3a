"""Between HTTP and the engine: turns validated bodies into engine requests, submits them to the scheduler and
hands the scheduler's events to the event loop.

No torch work happens on the event loop: tokenization runs on a tokenizer thread of its own, prefill, decode and
cache compilation on the scheduler's engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from jinja2 import TemplateError

from kvreuse.engine.generate import Generation
from kvreuse.engine.reuse import ReuseEngine
from kvreuse.engine.sampling import InvalidSampling, SamplingParams
from kvreuse.engine.scheduler import (GenerationJob, JobCancelled, JobEvent, JobTimeout, QueueFull, Scheduler,
                                     ShuttingDown)
from kvreuse.fusion.methods import Auto, parse_method
from kvreuse.fusion.segments import Request, Segment, SegmentKind, chat_request, chunk_ids, outside_vocabulary
from kvreuse.server.caches import CacheRegistry, ContextCache, is_cache_id
from kvreuse.server.config import ServerConfig
from kvreuse.server.errors import APIError, bad_request
from kvreuse.server.logprobs import TokenTexts
from kvreuse.server.metrics import Metrics
from kvreuse.server.protocol import (
    AutoChoice,
    CacheCreateRequest,
    CacheInfo,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationParams,
    KvreuseOptions,
    KvreuseUsage,
    PromptParts,
    PromptTokensDetails,
    TokenizeChatRequest,
    Usage,
)
from kvreuse.store.spec import parse_size

T = TypeVar("T")
RATIO_METHODS = {"cacheblend", "cachetune"}
DISCONNECT_POLL_SECONDS = 0.5  # how often a waiting request checks that its client is still there
RETRY_AFTER_SECONDS = 1  # what a 429 tells the client to wait: the queue drains as fast as requests finish
TOKENIZER_THREADS = 2  # one long text must not hold up every other request's tokenization
# Texts longer than a window of ordinary text (~4 characters a token: 32K for 8K tokens) are tokenized apart, on
# a thread of their own, a few at a time: one client sending them by the dozen (most end in a 400, too long, but
# only once tokenized) gets 429s, while the other requests' tokenization goes on.
LONG_TEXT_CHARACTERS = 65_536
MAX_LONG_TEXTS = 2  # being tokenized or waiting to be


@dataclasses.dataclass
class Prepared:
    """A request ready for the engine."""

    request: Request  # carries its tenant (cache salt)
    sampling: SamplingParams
    method: str
    choices: int = 1  # OpenAI's n


def method_spec(options: KvreuseOptions | None, default: str) -> str:
    """The method a request runs: its own `kvreuse.method`, or the server's, with `kvreuse.ratio` applied."""
    requested = None if options is None or options.method is None else options.method.strip()
    if requested == "":
        raise bad_request("kvreuse.method is empty: name a method (e.g. cacheblend:0.15) or leave it out for the "
                          "server's default", "kvreuse.method")
    method = requested or default
    if options is not None and options.ratio is not None:
        name, _, arg = method.partition(":")
        if requested and arg:
            raise bad_request(f"kvreuse.ratio: method {method!r} already sets its parameter", "kvreuse.ratio")
        if name not in RATIO_METHODS:
            raise bad_request(f"kvreuse.ratio: {name} takes no ratio (only {', '.join(sorted(RATIO_METHODS))})",
                              "kvreuse.ratio")
        method = f"{name}:{options.ratio:g}"
    try:
        parse_method(method)
    except ValueError as e:
        raise bad_request(f"kvreuse.{e}", "kvreuse.method") from None
    return method


def usage_of(results: list[Generation], choices_per_prompt: int = 1) -> Usage:
    """A request's usage: each prompt once, the tokens of every choice; for a request of one prompt, how its KV was
    obtained (once for all its choices) and its first token's time (several prompts each have their own)."""
    prompts = results[::choices_per_prompt]  # each prompt's first choice (choice i x n + j: prompt i's choice j)
    prompt_tokens = sum(r.prompt_tokens for r in prompts)
    completion = sum(len(r.token_ids) for r in results)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(r.stats.cached_tokens for r in prompts)),
        kvreuse=_kvreuse_usage(results) if len(prompts) == 1 else None,
    )


def _kvreuse_usage(results: list[Generation]) -> KvreuseUsage:
    """How one prompt's KV was obtained, and its first token's time; `results`: its choices."""
    s, fusion = results[0].stats, results[0].stats.fusion
    return KvreuseUsage(
        method=fusion.method,
        reused_tokens=fusion.reused_tokens,
        restored_prefix_tokens=s.prefix.restored_tokens,
        restored_loaded_tokens_by_tier=s.prefix.loaded_tokens_by_tier,
        restore_seconds=s.prefix.seconds,
        computed_tokens=fusion.computed_tokens_layer0,
        recompute_share=fusion.recompute_share,
        loaded_tokens_by_tier=s.loaded_tokens_by_tier,
        chunk_hits=s.chunk_hits,
        chunks=s.chunks,
        load_seconds=fusion.load_seconds,
        compute_seconds=fusion.prefill_seconds - fusion.load_wait_seconds,
        paused_seconds=fusion.paused_seconds,
        queue_seconds=s.queue_seconds,
        ttft_seconds=min(r.ttft for r in results),
        auto=None if s.auto is None else AutoChoice(requested_method=s.auto.requested_method or "auto",
                                                     predicted_ttft_seconds=s.auto.predicted_ttft,
                                                     candidates=s.auto.candidates),
    )


def error_of(error: BaseException) -> APIError:
    """The HTTP error for a job that ended without a result."""
    if isinstance(error, JobTimeout):
        return APIError(408, str(error), code="timeout")
    if isinstance(error, ShuttingDown):
        return APIError(503, str(error), code="shutting_down")
    if isinstance(error, JobCancelled):
        return APIError(499, str(error), code="cancelled")
    # every client error is refused before its job is submitted: anything else, ValueError included, is a bug
    return APIError(500, f"generation failed: {type(error).__name__}")


class JobStream:
    """The events of one request's jobs (one a prompt) on the event loop, their choices numbered across the jobs
    in order; leaving the iteration early cancels the jobs."""

    def __init__(self, jobs: list[GenerationJob], events: asyncio.Queue[JobEvent]):
        self.jobs, self._events = jobs, events
        self.choices = sum(job.choices for job in jobs)

    async def events(self, disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[JobEvent]:
        """The jobs' events until the last (an error, or the result of the last choice to finish); stops early
        (cancelling the jobs) once the client has gone, which is checked every DISCONNECT_POLL_SECONDS however fast
        events come."""
        loop = asyncio.get_running_loop()
        next_check = loop.time() + DISCONNECT_POLL_SECONDS
        unfinished = self.choices
        try:
            while True:
                try:
                    event = await asyncio.wait_for(self._events.get(), max(0.0, next_check - loop.time()))
                except TimeoutError:
                    event = None
                if loop.time() >= next_check:
                    if await disconnected():
                        return
                    next_check = loop.time() + DISCONNECT_POLL_SECONDS
                if event is None:
                    continue
                yield event
                unfinished -= event.result is not None
                if event.error or not unfinished:
                    return
        finally:
            for job in self.jobs:
                job.cancel()  # a no-op once it has finished

    async def results(self, disconnected: Callable[[], Awaitable[bool]]) -> list[Generation]:
        """Wait for the end; each choice's generation, in their order. Raises a job's error as an APIError."""
        results: dict[int, Generation] = {}
        async for event in self.events(disconnected):
            if event.error:
                raise error_of(event.error)
            if event.result:
                results[event.choice] = event.result
        if len(results) < self.choices:
            raise APIError(499, "the client disconnected", code="cancelled")
        return [results[choice] for choice in range(self.choices)]


# The body's sampling fields that SamplingParams takes as they are, under the same names
SAMPLING_FIELDS = ("top_p", "seed", "ignore_eos", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "min_tokens", "include_stop_str_in_output")


class EngineService:
    def __init__(self, engine: ReuseEngine, config: ServerConfig):
        self.engine, self.config = engine, config
        self.model_names = config.served_model_name or [engine.loaded.name]
        window = engine.model.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or window, window)
        self.vocab_size = engine.model.config.vocab_size
        # No token spans more characters than the longest vocabulary entry, so a text longer than this many
        # characters cannot fit the context window: refused before the tokenizer spends seconds on it.
        self.max_prompt_chars = self.max_model_len * max(map(len, engine.tokenizer.get_vocab()))
        self.caches = CacheRegistry()
        self.token_texts = TokenTexts(engine.tokenizer)  # used on the event loop only
        self.scheduler = Scheduler(engine, config.max_concurrency, config.max_queue,
                                   max_prefill_batch=config.max_prefill_batch,
                                   pool_bytes=parse_size(config.decode_pool),
                                   max_token_gap=None if config.max_token_gap_ms is None
                                   else config.max_token_gap_ms / 1e3)
        self.metrics = Metrics(lambda: self.scheduler.waiting, lambda: self.scheduler.running, engine.store,
                               engine.write_back)
        self.scheduler.on_decode_step = self.metrics.batch_size.observe
        self.created = int(time.time())
        self._tokenizer_threads = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="kv-tokenize")
        self._long_text_thread = ThreadPoolExecutor(1, thread_name_prefix="kv-tokenize-long")
        self._long_texts = 0  # on its way through that thread; only ever changed on the event loop
        self._compiling = 0  # context caches being created
        self._shutdown_timer: threading.Timer | None = None

    def start(self) -> None:
        if isinstance(parse_method(self.config.method), Auto):
            # Measured now, not by the first request on the engine thread while every stream waits (a fresh
            # machine has no profile; once measured it is saved).
            _ = self.engine.controller
        self.scheduler.start()

    def begin_shutdown(self, grace: float) -> None:
        """The server stops taking requests: those still running `grace` seconds from now end with an error
        their clients can read (a 503, or an error event and [DONE] in a stream), before the HTTP server cuts
        their connections."""
        self._shutdown_timer = threading.Timer(
            grace, self.scheduler.end_all, [ShuttingDown("the server is shutting down")])
        self._shutdown_timer.daemon = True
        self._shutdown_timer.start()

    def close(self) -> None:
        if self._shutdown_timer is not None:
            self._shutdown_timer.cancel()
        self.scheduler.stop()
        self._tokenizer_threads.shutdown(wait=True)
        self._long_text_thread.shutdown(wait=True)
        self.engine.close()

    # ---- validation and preparation ------------------------------------------------------------------------

    def check_model(self, name: str | None) -> str:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")
        return self.model_names[0]

    def _check_length(self, texts: list[str], param: str) -> int:
        """The texts' characters, refused if they cannot fit the window whatever their tokens."""
        characters = sum(map(len, texts))
        if characters > self.max_prompt_chars:
            raise bad_request(f"{param}: {characters} characters cannot fit the maximum context length of "
                              f"{self.max_model_len} tokens (at most {self.max_prompt_chars} characters)", param)
        return characters

    async def _tokenize(self, fn: Callable[[], T], param: str, characters: int = 0) -> T:
        """fn() on a tokenizer thread: a long text's (`characters`) on the long texts' one, if it has room."""
        long = characters > LONG_TEXT_CHARACTERS
        if long and self._long_texts >= MAX_LONG_TEXTS:
            self.metrics.queue_rejections.inc()
            raise APIError(429, f"{param}: {self._long_texts} texts of over {LONG_TEXT_CHARACTERS} characters are "
                                "being tokenized; retry later", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        self._long_texts += int(long)
        try:
            executor = self._long_text_thread if long else self._tokenizer_threads
            return await asyncio.get_running_loop().run_in_executor(executor, fn)
        except (ValueError, TemplateError) as e:  # a chat template may refuse a conversation (role order)
            raise bad_request(f"{param}: {e}", param) from None
        finally:
            self._long_texts -= int(long)

    def _check_token_ids(self, ids: list[int], param: str) -> list[int]:
        bad = outside_vocabulary(ids, self.vocab_size)
        if bad is not None:
            raise bad_request(f"{param}: token id {bad} is outside the vocabulary [0, {self.vocab_size})", param)
        return ids

    def _check_tokenized(self, ids: Iterable[int]) -> None:
        """Ids the tokenizer made of text (raises ValueError, on the tokenizer thread): one outside the model's
        vocabulary means a tokenizer that does not match the model's weights."""
        bad = outside_vocabulary(ids, self.vocab_size)
        if bad is not None:
            raise ValueError(f"the model's tokenizer gave token id {bad}, outside the model's vocabulary "
                             f"[0, {self.vocab_size}): its tokenizer does not match its weights")

    def _cached_chunks(self, cache_ids: list[str], salt: str | None) -> list[list[int]]:
        chunks = []
        for i, id_ in enumerate(cache_ids):
            param = f"cache_ids[{i}]"
            if not is_cache_id(id_):
                raise bad_request(f"{param}: {id_!r} is not a cache id", param)
            cache = self.caches.get(id_, salt)
            if cache is None:
                raise APIError(404, f"{param}: no cache with id {id_!r}", param, "cache_not_found")
            chunks.append(list(cache.token_ids))
        return chunks

    def _prepare(self, body: GenerationParams, request: Request, param: str) -> Prepared:
        room = self.max_model_len - len(request)
        budget = body.token_budget
        if room < 1 or (budget is not None and budget > room):
            raise bad_request(
                f"{param}: {len(request)} prompt tokens + {budget or 1} to generate exceed the maximum context "
                f"length of {self.max_model_len}", param)
        try:
            sampling = self._sampling(body, budget or min(self.config.default_max_tokens, room))
        except InvalidSampling as e:  # a combination the body's own checks cannot see (min_tokens > max_tokens)
            raise bad_request(str(e), e.param) from None
        return Prepared(request, sampling, method_spec(body.kvreuse, self.config.method), body.n)

    def _sampling(self, body: GenerationParams, max_tokens: int) -> SamplingParams:
        given = {name: value for name in SAMPLING_FIELDS if (value := getattr(body, name)) is not None}
        biases = body.token_biases
        self._check_token_ids(list(biases), "logit_bias")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,  # OpenAI's default, not greedy
            stop=body.stop_strings,
            stop_token_ids=self._check_token_ids(body.stop_token_ids or [], "stop_token_ids"),
            logit_bias=biases,
            logprobs=body.logprob_alternatives,
            **given,  # the others take SamplingParams' defaults where the body leaves them unset
        )

    def _refuse_unsupported(self, body: GenerationParams) -> None:
        if refusal := body.refusal():
            param, why = refusal
            raise bad_request(f"{param}: {why}", param)
        if body.n > self.config.max_concurrency:  # each choice decodes as a running request
            raise bad_request(f"n: at most {self.config.max_concurrency} choices (the server's --max-concurrency), "
                              f"got {body.n}", "n")

    async def prepare_chat(self, body: ChatCompletionRequest) -> list[Prepared]:
        self._refuse_unsupported(body)
        return [self._prepare(body, await self.chat_prompt(body), "messages")]

    async def chat_prompt(self, body: ChatCompletionRequest | TokenizeChatRequest) -> Request:
        """The prompt of a conversation: its template head and history, its cached and given documents, and its last
        message as the question."""
        if body.messages[-1].role != "user":
            raise bad_request("messages: the last message must be the user's", "messages")
        cached = self._cached_chunks(body.cache_ids, body.cache_salt)
        history = [{"role": m.role, "content": m.text} for m in body.messages[:-1]]
        question = body.messages[-1].text
        characters = self._check_length([*body.documents, *(m["content"] for m in history), question], "messages")
        tokenizer = self.engine.tokenizer

        def build() -> Request:
            documents = [chunk_ids(tokenizer, d) for d in body.documents]
            request = chat_request(tokenizer, history, cached + documents, question, body.cache_salt)
            self._check_tokenized(request.token_ids)
            return request

        return await self._tokenize(build, "messages", characters)

    async def prepare_completion(self, body: CompletionRequest) -> list[Prepared]:
        """One prepared job for each of the request's prompts (vLLM's batch of prompts)."""
        self._refuse_unsupported(body)
        prompts = body.prompts
        # Even on an idle server, --max-concurrency // n of the prompts run at once and the others wait in the queue
        most = self.config.max_concurrency // body.n + self.config.max_queue
        if len(prompts) > most:  # more could never be queued at once: a 429 would be retried in vain
            raise bad_request(f"prompt: {len(prompts)} prompts of n={body.n}; at most {most} in one request (the "
                              f"server's --max-concurrency // n + --max-queue)", "prompt")
        requests = await self.completion_prompts(body, prompts)
        return [self._prepare(body, request, param) for request, param in zip(requests, self._prompt_params(prompts))]

    @staticmethod
    def _prompt_params(prompts: list) -> list[str]:
        """How errors name each prompt: prompt, or prompt[i] in a batch."""
        return ["prompt"] if len(prompts) == 1 else [f"prompt[{i}]" for i in range(len(prompts))]

    async def completion_prompts(self, body: PromptParts, prompts: list[str | list[int]]) -> list[Request]:
        """The prompts of a completion (texts or token ids), each after the request's cached and given documents,
        which are tokenized once for all of them."""
        chunks = self._cached_chunks(body.cache_ids, body.cache_salt)
        if body.documents:
            characters = self._check_length(body.documents, "prompt")
            chunks += await self._tokenize(lambda: [self._tokenized_chunk(d) for d in body.documents], "prompt",
                                           characters)
        tokenizer = self.engine.tokenizer

        def build(prompt: str | list[int], param: str) -> Request:
            ids = self._check_token_ids(prompt, param) if isinstance(prompt, list) else tokenizer.encode(prompt)
            if not ids:
                raise ValueError("must not be empty")
            self._check_tokenized(ids)
            return Request([*(Segment(SegmentKind.CHUNK, c) for c in chunks), Segment(SegmentKind.FRESH, ids)],
                           body.cache_salt)

        requests = []
        for prompt, param in zip(prompts, self._prompt_params(prompts)):
            text = prompt if isinstance(prompt, str) else ""
            self._check_length([*body.documents, text], param)
            requests.append(await self._tokenize(functools.partial(build, prompt, param), param, len(text)))
        return requests

    async def echoed_prompt(self, prompt: str | list[int]) -> str:
        """A completion's prompt as `echo` returns it before the generated text: its text, or its token ids'."""
        return prompt if isinstance(prompt, str) else await self.detokenize(prompt)

    async def detokenize(self, ids: list[int]) -> str:
        if len(ids) > self.max_model_len:  # no prompt or generation holds more
            raise bad_request(f"tokens: {len(ids)} tokens, more than the maximum context length of "
                              f"{self.max_model_len}", "tokens")
        self._check_token_ids(ids, "tokens")
        return await self._tokenize(lambda: self.engine.tokenizer.decode(ids), "tokens")

    # ---- generation ------------------------------------------------------------------------------------

    def submit(self, prepared: list[Prepared]) -> JobStream:
        """Queue a request's jobs, all or none; their events come numbered across them (prompt i's choice j is
        choice i x n + j, as OpenAI numbers a batch's choices)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[JobEvent] = asyncio.Queue()

        def deliver_from(first_choice: int) -> Callable[[JobEvent], None]:
            def deliver(event: JobEvent) -> None:
                event = dataclasses.replace(event, choice=first_choice + event.choice)
                with contextlib.suppress(RuntimeError):  # the loop has closed: the server is shutting down
                    loop.call_soon_threadsafe(events.put_nowait, event)
            return deliver

        jobs, first = [], 0
        for p in prepared:
            jobs.append(GenerationJob(p.request, p.sampling, deliver_from(first), p.method,
                                      timeout=self.config.request_timeout, choices=p.choices))
            first += p.choices
        try:
            self.scheduler.submit_all(jobs)
        except QueueFull as e:
            self.metrics.queue_rejections.inc()
            raise APIError(429, f"{e}; retry later", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        return JobStream(jobs, events)

    # ---- the context-cache API ---------------------------------------------------------------------------

    async def create_cache(self, body: CacheCreateRequest, disconnected: Callable[[], Awaitable[bool]]
                           ) -> CacheInfo:
        self.check_model(body.model)
        if (body.text is None) == (body.token_ids is None):
            raise bad_request("text: give exactly one of text and token_ids", "text")
        param = "text" if body.text is not None else "token_ids"
        if body.text is not None:
            characters = self._check_length([body.text], param)
            ids = await self._tokenize(lambda: self._tokenized_chunk(body.text), param, characters)
        else:
            ids = self._check_token_ids(body.token_ids, param)
        if len(ids) > self.max_model_len:
            raise bad_request(f"{param}: {len(ids)} tokens exceed the maximum context length of "
                              f"{self.max_model_len}", param)
        keys = await self._compiled(ids, body.cache_salt, disconnected)
        return await self.cache_info(self.caches.add(ids, body.cache_salt, keys))

    async def _compiled(self, ids: list[int], salt: str | None, disconnected: Callable[[], Awaitable[bool]]
                        ) -> list[str]:
        """Compile on the engine thread, as admission treats a prompt: a bounded number pending (429 beyond),
        abandoned past the request timeout (408) or once the client has gone, before it starts or at its next
        layer; running sequences decode between its layers by --max-token-gap-ms."""
        if self._compiling >= self.config.max_concurrency:
            self.metrics.queue_rejections.inc()
            raise APIError(429, f"{self._compiling} caches are being created; retry later", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        self._compiling += 1  # only ever changed on the event loop
        abandoned = threading.Event()
        compiled = asyncio.wrap_future(self.scheduler.call(lambda: self._compile(ids, salt), abandoned))
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout
        try:
            while True:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    raise APIError(408, f"the cache was not created within {self.config.request_timeout:g} s",
                                   code="timeout")
                done, _ = await asyncio.wait([compiled], timeout=min(left, DISCONNECT_POLL_SECONDS))
                if done:
                    try:
                        return compiled.result()
                    except JobCancelled as e:  # the server is shutting down
                        raise error_of(e) from None
                if await disconnected():
                    raise APIError(499, "the client disconnected", code="cancelled")
        finally:
            abandoned.set()  # a no-op once done; a compilation under way stops at its next layer
            compiled.cancel()  # one not yet started never runs
            self._compiling -= 1

    def _compile(self, ids: list[int], salt: str | None) -> list[str]:
        """On the engine thread: compile the chunk in the default method's mode; returns its store key."""
        request = Request([Segment(SegmentKind.CHUNK, ids)], salt)
        self.engine.compile(request, [self.config.method])
        return [self.engine.key_of(request, request.segments[0], parse_method(self.config.method))]

    def _tokenized_chunk(self, text: str) -> list[int]:
        ids = chunk_ids(self.engine.tokenizer, text)
        self._check_tokenized(ids)
        return ids

    def find_cache(self, id_: str, salt: str | None) -> ContextCache:
        cache = self.caches.get(id_, salt) if is_cache_id(id_) else None
        if cache is None:
            raise APIError(404, f"no cache with id {id_!r}", "cache_id", "cache_not_found")
        return cache

    async def cache_info(self, cache: ContextCache) -> CacheInfo:
        stored = await asyncio.to_thread(lambda: all(self.engine.store.meta(k) is not None for k in cache.keys))
        return CacheInfo(id=cache.id, created=cache.created, tokens=len(cache.token_ids), stored=stored)

    async def delete_cache(self, id_: str, salt: str | None) -> None:
        cache = self.find_cache(id_, salt)
        self.caches.remove(id_, salt)
        # Requests that used the cache with another compile mode's method (legolink0) stored its KV under that
        # mode's key too: the delete removes every one.
        keys = {*cache.keys, *self.engine.chunk_keys(cache.token_ids, salt)}
        await asyncio.to_thread(lambda: [self.engine.store.delete(k) for k in keys])
