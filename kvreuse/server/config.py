"""The server's settings: defaults, then a YAML file, then KVREUSE_* environment variables, then command-line
flags, each overriding the one before."""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvreuse.fusion.methods import DEFAULT_METHOD, parse_method
from kvreuse.model.options import DECODE_WEIGHTS, DTYPE_NAMES
from kvreuse.store.spec import DEFAULT_STORE, parse_size, parse_store_spec

ENV_PREFIX = "KVREUSE_"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's
CHOICES = {"placement": ("all", "cost"), "batch_restore": ("auto", "on", "off"), "dtype": DTYPE_NAMES,
           "decode_weights": DECODE_WEIGHTS, "log_level": LOG_LEVELS}  # the settings that name one of a few


@dataclass
class ServerConfig:
    model: str | None = None  # HF directory or .gguf file; None: the embedded SmolLM2-135M-Instruct
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    allowed_origins: list[str] = field(default_factory=list)  # web pages that may call the API (CORS); "*": any
    served_model_name: list[str] = field(default_factory=list)  # names clients use; default: the model's name
    store: str = DEFAULT_STORE
    prefix_block_size: int = 256  # tokens per stored block of a conversation's exact prefix (whole blocks reused)
    method: str = DEFAULT_METHOD  # reuse method of requests that do not choose one
    placement: str = "all"  # new chunks on every tier ("all"), or on the slowest whose reads hide ("cost")
    max_concurrency: int = 8  # sequences prefilled and decoded together
    max_prefill_batch: int = 4  # waiting requests prefilled per step, their stored prefixes restored together
    max_token_gap_ms: float | None = None  # running streams decode between prompt layers after this wait
    decode_pool: str = "4GB"  # the running sequences' KV, decoded in one attention call per layer (KVPool)
    batch_restore: str = "auto"  # on, off, auto: together only when a tier's reads wait (ReuseEngine)
    max_queue: int = 256  # requests waiting beyond those; one more is refused with 429
    request_timeout: float = 600.0  # seconds from arrival (queueing included) until a request is abandoned
    max_model_len: int | None = None  # prompt + generated tokens; default: the model's context window
    default_max_tokens: int = 256  # generation budget of a chat request that sets none
    max_request_bytes: int = 4 << 20  # a larger body is refused (413) before it is read whole
    shutdown_timeout: float = 10.0  # seconds a stopping server lets requests in flight finish, then cancels them
    dtype: str = "float32"
    decode_weights: str = "model"  # or "int8": decoding over int8 copies of the weights (LayerwiseModel.decode_in_int8)
    log_level: str = "info"

    def __post_init__(self) -> None:
        if isinstance(self.api_key, str):  # a secret file's trailing newline: clients send the key without it
            self.api_key = self.api_key.strip()
        parse_method(self.method)  # a bad one is named before the model loads, not in the server's start-up
        try:
            parse_store_spec(self.store)  # read, not opened: that waits for the model, whose entries it holds
        except ValueError as e:
            raise ValueError(f"store: {e}") from None
        checks = {
            "port": 0 <= self.port <= 65535,
            # an empty key (KVREUSE_API_KEY= from an unset secret) would leave the API open without a word
            "api_key": self.api_key is None or bool(self.api_key.strip()),
            "prefix_block_size": self.prefix_block_size >= 1,
            "max_concurrency": self.max_concurrency >= 1,
            "max_prefill_batch": self.max_prefill_batch >= 1,
            "max_token_gap_ms": self.max_token_gap_ms is None or self.max_token_gap_ms >= 0,
            "decode_pool": _is_size(self.decode_pool),
            "max_queue": self.max_queue >= 0,
            "request_timeout": self.request_timeout > 0,
            "max_model_len": self.max_model_len is None or self.max_model_len >= 2,
            "default_max_tokens": self.default_max_tokens >= 1,
            "max_request_bytes": self.max_request_bytes >= 1024,
            "shutdown_timeout": self.shutdown_timeout >= 0,
            **{name: getattr(self, name) in choices for name, choices in CHOICES.items()},
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            expected = f"; expected one of {', '.join(CHOICES[bad[0]])}" if bad[0] in CHOICES else ""
            raise ValueError(f"{bad[0]}: invalid value {getattr(self, bad[0])!r}{expected}")


def _is_size(text: str) -> bool:
    try:
        parse_size(text)
    except ValueError:
        return False
    return True


FIELDS = {f.name: f for f in dataclasses.fields(ServerConfig)}


def _field_type(name: str) -> type:
    """The non-None type of a field, e.g. int for `int | None`."""
    hint = typing.get_type_hints(ServerConfig)[name]
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_origin(hint) or hint


def _coerce(name: str, value: Any, source: str) -> Any:
    kind = _field_type(name)
    # YAML's true is not port 1, nor 8000.9 port 8000: a number must be one of the setting's kind as it is
    wrong_number = isinstance(value, bool) or (kind is int and isinstance(value, float))
    try:
        if wrong_number:
            raise TypeError
        if kind is list:
            return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else list(value)
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{source}: {name} must be {kind.__name__}, got {value!r}") from None


def from_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"config {path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config {path}: expected a mapping of settings, got {type(data).__name__}")
    settings = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(settings) - set(FIELDS))
    if unknown:
        raise ValueError(f"config {path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(FIELDS)}")
    if "api_key" in settings and settings["api_key"] is None:  # a templated secret left unset: not an open API
        raise ValueError(f"config {path}: api_key is empty; give the key, or leave the setting out for no key")
    # a setting left empty (port:) keeps its default, as a null in a request's body does
    return {k: _coerce(k, v, f"config {path}") for k, v in settings.items() if v is not None}


def from_env(environ: typing.Mapping[str, str]) -> dict[str, Any]:
    """KVREUSE_PORT=9000 and the like; other KVREUSE_* variables (KVREUSE_CACHE_DIR) belong to other parts."""
    found = {}
    for name in FIELDS:
        variable = ENV_PREFIX + name.upper()
        if variable in environ:
            found[name] = _coerce(name, environ[variable], variable)
    return found


def load_config(flags: dict[str, Any], config_file: str | None = None,
                environ: typing.Mapping[str, str] | None = None) -> ServerConfig:
    """Defaults < YAML file (`config_file`, else $KVREUSE_CONFIG) < environment < flags; a flag left at None
    does not override."""
    environ = os.environ if environ is None else environ
    config_file = config_file or environ.get(ENV_PREFIX + "CONFIG")
    settings = from_yaml(config_file) if config_file else {}
    settings.update(from_env(environ))
    settings.update({k: v for k, v in flags.items() if v is not None})
    return ServerConfig(**settings)
