"""`kvreuse serve [MODEL]`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvreuse.server.config import ServerConfig

# flag -> (type, help); every default is None so that unset flags leave the YAML file and environment in force
FLAGS = {
    "--host": (str, "address to listen on (default 127.0.0.1)"),
    "--port": (int, "port (default 8000)"),
    "--api-key": (str, "require 'Authorization: Bearer KEY' on every path but /health and /metrics"),
    "--store": (str, "store spec, e.g. memory:4GB,disk:/var/cache/kvreuse,redis://host:6379 (default memory:4GB)"),
    "--prefix-block-size": (int, "tokens per stored block of a conversation's prefix; whole blocks are reused (256)"),
    "--method": (str, "reuse method of requests that choose none (default guarded:3.5e-4:sinks=4:examples=448; "
                      "auto: the fastest meeting a quality floor, e.g. auto:kl=0.1)"),
    "--placement": (str, "where new chunks are stored: every tier (all, default) or the slowest tier whose reads "
                         "hide behind recompute (cost)"),
    "--max-concurrency": (int, "sequences prefilled and decoded together (default 8)"),
    "--max-prefill-batch": (int, "waiting requests prefilled per step, their stored prefixes restored together "
                                 "as CacheFlow restores a batch (default 4; 1: one at a time)"),
    "--max-token-gap-ms": (float, "while prompts are computed, running streams take a decoding step between two "
                                  "layers once they have waited this long for a token (0: between every two "
                                  "layers; default: none, prompts computed whole; see docs/SERVER.md for its cost)"),
    "--decode-pool": (str, "memory for the running sequences' KV, decoded together in one attention call per "
                           "layer; a sequence that does not fit decodes from its own cache (default 4GB)"),
    "--batch-restore": (str, "restore waiting requests' stored prefixes together: on, off, or auto (default: only "
                             "when a tier's reads wait on a device or the network)"),
    "--max-queue": (int, "requests that may wait beyond those; more get 429 (default 256)"),
    "--request-timeout": (float, "seconds from arrival, queueing included, before a request is abandoned (600)"),
    "--max-model-len": (int, "prompt + generated tokens (default: the model's context window)"),
    "--default-max-tokens": (int, "generation budget of a chat request that sets none (default 256)"),
    "--max-request-bytes": (int, "larger request bodies are refused with 413 (default 4 MiB)"),
    "--shutdown-timeout": (float, "seconds a stopping server lets requests finish before cancelling them (10)"),
    "--dtype": (str, "float32 (default), bfloat16 or float16"),
    "--decode-weights": (str, "the weights decoding multiplies: model (default: the model's own) or int8 (int8 "
                              "copies; fp32 models; prompts and stored KV keep fp32)"),
    "--log-level": (str, "uvicorn's log level (default info)"),
}


def add_arguments(serve: argparse.ArgumentParser) -> None:
    serve.description = ("Settings come from defaults, then --config (or $KVREUSE_CONFIG, YAML), then KVREUSE_* "
                         "environment variables (e.g. KVREUSE_PORT), then these flags.")
    serve.add_argument("model", nargs="?", default=None,
                       help="HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--served-model-name", nargs="+", default=None, help="model names clients use")
    serve.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                       help="web pages that may call the API from a browser (CORS), e.g. https://app.example.com; "
                            "'*': any (default: none)")
    serve.add_argument("--config", default=None, help="YAML file of settings (keys as the flags, e.g. max_queue)")
    for flag, (kind, help_text) in FLAGS.items():
        serve.add_argument(flag, type=kind, default=None, help=help_text)
    serve.set_defaults(func=cmd_serve)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    from kvreuse.server.config import load_config  # imports torch: not for `kvreuse serve --help`

    flags = {name: getattr(args, name) for name in
             ["model", "served_model_name", "allowed_origins", *(f[2:].replace("-", "_") for f in FLAGS)]}
    return load_config(flags, args.config)


def cmd_serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)  # a bad setting is named before the server's modules and the model load

    import uvicorn

    from kvreuse.controller.placement import PlacementPolicy
    from kvreuse.engine.reuse import ReuseEngine
    from kvreuse.server.app import GracefulServer, create_app
    from kvreuse.server.service import EngineService

    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    placement = PlacementPolicy() if config.placement == "cost" else None
    engine = ReuseEngine.load(config.model, config.store, config.dtype, config.decode_weights,
                              prefix_block_size=config.prefix_block_size,
                              batch_restore=config.batch_restore, placement=placement)
    service = EngineService(engine, config)
    # What the start made (modules, the model, its tokenizer: 400 thousand objects) lives as long as the process.
    # Frozen, the collector's full passes no longer walk it: 0.2 s each, a pause of every stream, and one more
    # when the process ends.
    gc.collect()
    gc.freeze()
    server_config = uvicorn.Config(create_app(service), host=config.host, port=config.port,
                                   log_level=config.log_level, timeout_graceful_shutdown=config.shutdown_timeout)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn raises the SIGINT it stopped on again, once stopped
        GracefulServer(server_config, service).run()
    return 0
