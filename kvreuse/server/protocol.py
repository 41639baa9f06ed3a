"""Request and response bodies: OpenAI's chat and completions formats (field for field as vLLM serves them),
our extensions (`documents`, `cache_ids`, `kvreuse`, `cache_salt`) and the context-cache API.

Unknown top-level fields are ignored, as OpenAI-compatible servers do; our own `kvreuse` block refuses them.
OpenAI parameters this server does not implement are refused by name rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator,
                      model_serializer, model_validator)

from kvreuse.engine.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS

SEED_RANGE = dict(ge=-(2**63), le=2**64 - 1)  # what torch.Generator.manual_seed accepts
# Every running sequence's text is checked against its stop strings after every token, on the engine thread
# that every stream shares: bounded here, as vLLM's users rarely need more than a few short ones.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARACTERS = 1000
MAX_REPETITION_PENALTY = 100.0  # past it every repeated token is out of reach anyway; bounds a client's typo
MAX_TOKEN_ID_DIGITS = 18  # a logit_bias key's (any int64 id; Python's int() refuses texts past 4300 digits)


def encodable(text: str) -> str:
    """JSON can carry a lone surrogate (\\ud800) that no tokenizer, store key or UTF-8 response can: refuse it
    where it enters, naming the field."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"text is not valid Unicode: a lone surrogate at character {e.start}") from None
    return text


Text = Annotated[str, AfterValidator(encodable)]  # every string the server accepts
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(encodable)]


class KvreuseOptions(BaseModel):
    """Per-request reuse options, sent as `extra_body={"kvreuse": {...}}`."""

    model_config = ConfigDict(extra="forbid")
    method: Text | None = Field(None, description="reuse method, e.g. cacheblend, cacheblend:0.3, naive, full")
    ratio: float | None = Field(None, ge=0, le=1, description="recompute ratio of cacheblend or cachetune")


class StreamOptions(BaseModel):
    include_usage: bool | None = False  # null: not asked for, as at the top level


class TextPart(BaseModel):
    type: str
    text: Text

    @field_validator("type", mode="before")
    @classmethod
    def _text_only(cls, kind: Any) -> Any:
        if kind != "text":
            raise ValueError(f"only text content parts are supported, got a part of type {kind!r}")
        return kind


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")  # vLLM's


class PromptParts(BaseModel):
    """What a prompt holds beside its text, and whose it is: what generation requests and /tokenize share."""

    model: Text | None = Field(None, description="a served model name (default: the first)")
    documents: list[NonEmptyText] = Field(default_factory=list, description="reusable chunks, placed in order")
    cache_ids: list[Text] = Field(default_factory=list, description="ids from POST /v1/caches, placed first")
    cache_salt: NonEmptyText | None = Field(None, description="tenant: store entries are shared only within it")


class GenerationParams(PromptParts):
    """What chat and completion requests share: sampling, streaming, and our reuse extensions."""

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, **SEED_RANGE)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, description="choices sampled from the one prompt (at most the server's concurrency)")
    user: Text | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, description="token id (as text) -> bias added to its logit")
    # vLLM's sampling parameters, which clients written for it send
    ignore_eos: bool = False
    top_k: int | None = Field(None, ge=-1, description="the k most likely tokens only; 0 or -1: all (vLLM)")
    min_p: float | None = Field(None, ge=0, le=1, description="drop tokens below min_p x the top one's probability")
    repetition_penalty: float | None = Field(None, gt=0, le=MAX_REPETITION_PENALTY)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_STRINGS)
    min_tokens: int | None = Field(None, ge=0)
    include_stop_str_in_output: bool = False
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    kvreuse: KvreuseOptions | None = None

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        for i, text in enumerate(stops):
            if len(text) > MAX_STOP_CHARACTERS:
                raise ValueError(f"stop string {i} has {len(text)} characters; at most {MAX_STOP_CHARACTERS}")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_and_bounded_biases(cls, biases: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (biases or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS):
                raise ValueError(f"{key[:40]!r} is not a token id (a whole number >= 0 of at most "
                                 f"{MAX_TOKEN_ID_DIGITS} digits, as text)")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN fails it too
                raise ValueError(f"token {key}'s bias {bias} is outside [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        return biases

    @property
    def token_biases(self) -> dict[int, float]:
        return {int(key): bias for key, bias in (self.logit_bias or {}).items()}

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, body: Any) -> Any:
        """A field sent as null takes its default, as OpenAI's API (which types most of them nullable) and vLLM
        take it: clients serialise unset options that way."""
        if isinstance(body, dict):
            return {name: value for name, value in body.items() if value is not None}
        return body

    @field_validator("stream_options")
    @classmethod
    def _only_with_stream(cls, options: StreamOptions, info: ValidationInfo) -> StreamOptions:
        if not info.data.get("stream"):  # as OpenAI and vLLM answer it (stream is validated before it)
            raise ValueError("stream_options is only allowed when stream is true")
        return options

    def refusal(self) -> tuple[str, str] | None:
        """(parameter, why) of the first parameter set to something this server does not implement."""
        guided = {name: getattr(self, name) is not None and "guided decoding is not supported" for name in GUIDED}
        unsupported = {
            **guided,
            **self._unsupported(),
        }
        return next(((param, why) for param, why in unsupported.items() if why), None)

    def _unsupported(self) -> dict[str, str | bool]:
        return {}

    @property
    def token_budget(self) -> int | None:
        """max_tokens as the request sets it (None: the server's default)."""
        return None

    @property
    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def logprob_alternatives(self) -> int | None:
        """How many most likely tokens to report beside each chosen one's log-probability (None: no logprobs)."""
        return None


class ChatCompletionRequest(GenerationParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None  # the deprecated form of tools
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None

    def _unsupported(self) -> dict[str, str | bool]:
        return {
            "top_logprobs": self.top_logprobs is not None and not self.logprobs
            and "top_logprobs needs logprobs set to true",
            "tools": bool(self.tools) and "tool calling is not supported",
            "tool_choice": self.tool_choice not in (None, "none", "auto") and "tool calling is not supported",
            "functions": bool(self.functions) and "function calling is not supported",
            "function_call": self.function_call not in (None, "none", "auto")
            and "function calling is not supported",
            "modalities": bool(self.modalities and set(self.modalities) != {"text"})
            and "only text output is supported",
            "audio": self.audio is not None and "audio output is not supported",
            "prediction": self.prediction is not None and "predicted outputs are not supported",
            "response_format": bool(self.response_format and self.response_format.get("type") != "text")
            and "only the text response format is supported",
        }

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprob_alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationParams):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Text | None = None
    best_of: int | None = Field(None, ge=1)

    def _unsupported(self) -> dict[str, str | bool]:
        return {
            "echo": self.echo and self.logprobs is not None
            and "echo with logprobs is not supported: the prompt's log-probabilities are not computed",
            "suffix": bool(self.suffix) and "suffix is not supported",
            "best_of": self.best_of not in (None, 1) and "only best_of=1 is supported",
        }

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one text or list of token ids, or a list of them (a batch, as vLLM takes it)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)
        return [prompt]

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens

    @property
    def logprob_alternatives(self) -> int | None:
        return self.logprobs


# ---- responses -----------------------------------------------------------------------------------------


class AutoChoice(BaseModel):
    """What method auto chose it from: the cost model's TTFT for it and for every candidate."""

    requested_method: str = Field(description="the method as asked, e.g. auto:kl=0.35")
    predicted_ttft_seconds: float
    candidates: dict[str, float] = Field(description="each candidate method's predicted TTFT, in seconds")


class KvreuseUsage(BaseModel):
    """How the prompt's KV was obtained."""

    method: str
    reused_tokens: int = Field(description="prompt tokens whose stored chunk KV was placed")
    restored_prefix_tokens: int = Field(description="exact-prefix tokens restored from stored blocks (Cake/CacheFlow)")
    restored_loaded_tokens_by_tier: dict[str, int] = Field(description="of those, the tokens loaded, per tier")
    restore_seconds: float = Field(description="restoring the exact prefix")
    computed_tokens: int = Field(description="prompt rows computed at layer 0, fresh tokens included")
    recompute_share: float = Field(description="share of reused chunk rows recomputed, averaged over layers")
    loaded_tokens_by_tier: dict[str, int]
    chunk_hits: int
    chunks: int
    load_seconds: float = Field(description="reading stored KV (overlaps compute)")
    compute_seconds: float = Field(description="prefill time not spent waiting for stored KV")
    paused_seconds: float = Field(description="running sequences' decoding steps between the prompt's layers "
                                              "(in ttft_seconds, not in compute_seconds)")
    queue_seconds: float
    ttft_seconds: float = Field(description="arrival to first token, queueing included")
    auto: AutoChoice | None = Field(None, description="method auto's choice, when the request ran it")


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    kvreuse: KvreuseUsage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]  # the token's text in UTF-8


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]  # the most likely tokens at its step, most likely first


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    """The completions API's older form: one list per field, a token's alternatives keyed by their text."""

    text_offset: list[int]
    token_logprobs: list[float]
    tokens: list[str]
    top_logprobs: list[dict[str, float]]  # the most likely tokens and the chosen one


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str
    stop_reason: str | int | None = None  # the stop string or stop token that ended it, as vLLM gives it


class ResponseBase(BaseModel):
    """The fields every completion response and stream chunk starts with (OpenAI's order)."""

    id: str
    object: str
    created: int
    model: str


class ChatCompletionResponse(ResponseBase):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    """Only what changed: the role in the first chunk, text after it, nothing in the last."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _changed_only(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(ResponseBase):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(ResponseBase):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvreuse"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ---- the context-cache API -----------------------------------------------------------------------------


class TokenizeChatRequest(PromptParts):
    """vLLM's /tokenize of a conversation: the prompt a chat request of these messages and documents would run."""

    model_config = ConfigDict(extra="forbid")
    messages: list[ChatMessage] = Field(min_length=1)


class TokenizeCompletionRequest(PromptParts):
    model_config = ConfigDict(extra="forbid")
    prompt: Text | list[int]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Text | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class CacheCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Text | None = None
    text: NonEmptyText | None = Field(None, description="a document; tokenized exactly as in `documents`")
    token_ids: list[int] | None = Field(None, min_length=1)
    cache_salt: NonEmptyText | None = None


class CacheInfo(BaseModel):
    id: str
    object: Literal["kvreuse.cache"] = "kvreuse.cache"
    created: int
    tokens: int
    stored: bool = Field(description="whether the store still holds its KV (it may have been evicted)")


class CacheDeleted(BaseModel):
    id: str
    object: Literal["kvreuse.cache.deleted"] = "kvreuse.cache.deleted"
    deleted: bool = True
