"""`kvreuse generate`: answer a prompt, optionally over reusable documents; print the text and its TTFT."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvreuse.cli.arguments import add_model_args, store_spec
from kvreuse.store.spec import DEFAULT_STORE

DEFAULT_MAX_TOKENS = 128


def add_arguments(gen: argparse.ArgumentParser) -> None:
    add_model_args(gen)
    gen.add_argument("--prompt", required=True, help="the question or instruction (fresh text)")
    gen.add_argument("--document", type=_document, action="append", default=[], metavar="FILE",
                     help="a text file placed before the prompt as a reusable chunk (repeatable)")
    gen.add_argument("--method", default=None, help="reuse method, e.g. cacheblend:0.15, naive, full (default: the guarded one, see README)")
    gen.add_argument("--store", type=store_spec, default=DEFAULT_STORE, help="store spec, e.g. disk:/var/cache/kvreuse")
    gen.add_argument("--warm", action="store_true", help="compile the documents into the store before timing")
    gen.add_argument("--max-tokens", type=int, default=None,
                     help=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS}, or the room the window leaves)")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.set_defaults(func=cmd_generate)


def _document(path: str) -> str:
    """A --document's text, read when the command starts: what is wrong with the file is named before the model
    loads, with the file's name."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise argparse.ArgumentTypeError(f"{path!r} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{path!r}: {e.strerror}") from None
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{path!r} holds no text")
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from kvreuse.engine.reuse import ReuseEngine
    from kvreuse.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens or DEFAULT_MAX_TOKENS, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed, stop=args.stop)  # checked before the model loads
    engine = ReuseEngine.load(args.model, args.store, args.dtype, args.decode_weights)
    try:
        request = engine.build_request(args.document, args.prompt)
        if args.max_tokens is None:  # the default, as the server's: no more than the window leaves room for
            room = engine.model.config.max_position_embeddings - len(request)
            params = replace(params, max_tokens=max(1, min(DEFAULT_MAX_TOKENS, room)))
        if args.warm:
            engine.compile(request, [args.method])
        result = engine.generate(request, args.method, params)
    finally:
        engine.close()
    print(result.text)
    stats = result.stats.fusion
    print(
        f"[{engine.loaded.name}] {stats.method}: prompt {result.prompt_tokens} tokens "
        f"({stats.loaded_tokens} loaded, {stats.computed_tokens_layer0} computed), generated "
        f"{len(result.token_ids)} ({result.finish_reason}); TTFT {result.ttft * 1000:.0f} ms, "
        f"total {result.total_seconds:.2f} s",
        file=sys.stderr,
    )
    return 0
