"""The `kvreuse` command."""

from __future__ import annotations

import argparse
import sys

from kvreuse.bench.fusion import add_arguments as add_fusion_arguments
from kvreuse.bench.fusion import main as run_fusion_bench
from kvreuse.bench.ttft_cli import add_arguments as add_ttft_arguments
from kvreuse.bench.ttft_cli import main as run_ttft_bench
from kvreuse.controller.cli import add_commands as add_profile_commands
from kvreuse.eval.analyses.cli import add_commands as add_analysis_commands
from kvreuse.eval.cli import add_commands as add_eval_commands
from kvreuse.model.adapters import UnsupportedModelError
from kvreuse.model.loader import DTYPES, ModelLoadError
from kvreuse.restore.cli import add_commands as add_restore_commands
from kvreuse.server.cli import add_commands as add_serve_commands
from kvreuse.store.cli import add_commands as add_cache_commands

GATE_PROMPT = (
    "The KV cache of a transformer holds the keys and values of every token it has read. Reusing it for a "
    "document that appears again, even at a new position, saves recomputing the whole prefill."
)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None,
        help="local Hugging Face directory or .gguf file (default: embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))


def cmd_generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvreuse.engine.reuse import ReuseEngine
    from kvreuse.engine.sampling import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed, stop=args.stop
    )
    documents = [Path(p).read_text() for p in args.document]
    engine = ReuseEngine.load(args.model, args.store, args.dtype)
    try:
        request = engine.build_request(documents, args.prompt)
        if args.warm:
            engine.compile(request, [args.method])
        result = engine.generate(request, args.method, params)
    finally:
        engine.close()
    print(result.text)
    stats = result.stats
    print(
        f"[{engine.loaded.name}] {stats['method']}: prompt {result.prompt_tokens} tokens "
        f"({stats['loaded_tokens']} loaded, {stats['computed_tokens_layer0']} computed), generated "
        f"{len(result.token_ids)} ({result.finish_reason}); TTFT {result.ttft * 1000:.0f} ms, "
        f"total {result.total_seconds:.2f} s",
        file=sys.stderr,
    )
    return 0


def cmd_check_model(args: argparse.Namespace) -> int:
    from kvreuse.model.check import gate_prompt_ids, run_gate
    from kvreuse.model.loader import load_model

    loaded = load_model(args.model, "float32")
    prompt_ids = gate_prompt_ids(loaded.runtime, lambda text: loaded.tokenizer(text).input_ids, GATE_PROMPT)
    results = run_gate(loaded.runtime, prompt_ids)
    for result in results:
        print(f"{'PASS' if result.passed else 'FAIL'}  {result.name}: {result.detail}")
    passed = all(r.passed for r in results)
    print(f"{loaded.name}: {'passes' if passed else 'FAILS'} the correctness gate")
    return 0 if passed else 1


def cmd_bench_prefill(args: argparse.Namespace) -> int:
    from kvreuse.bench.prefill import run

    run(args.model, args.lengths, args.repeats)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvreuse", description="Reuse KV caches of long prompts.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser(
        "generate", help="answer a prompt, optionally over reusable documents; print the text and its TTFT"
    )
    _add_model_args(gen)
    gen.add_argument("--prompt", required=True, help="the question or instruction (fresh text)")
    gen.add_argument("--document", action="append", default=[], metavar="FILE",
                     help="a text file placed before the prompt as a reusable chunk (repeatable)")
    gen.add_argument("--method", default=None, help="reuse method, e.g. cacheblend:0.15 (default), naive, full")
    gen.add_argument("--store", default="memory:4GB", help="store spec, e.g. disk:/var/cache/kvreuse")
    gen.add_argument("--warm", action="store_true", help="compile the documents into the store before timing")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.set_defaults(func=cmd_generate)

    check = commands.add_parser("check-model", help="run the correctness gate on a model")
    check.add_argument("model", nargs="?", default=None, help="HF directory or .gguf file (default: embedded model)")
    check.set_defaults(func=cmd_check_model)

    bench = commands.add_parser("bench", help="benchmarks")
    benches = bench.add_subparsers(dest="bench", required=True)
    prefill = benches.add_parser("prefill", help="full prefill: our runtime vs transformers, side by side")
    _add_model_args(prefill)
    prefill.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    prefill.add_argument("--repeats", type=int, default=3)
    prefill.set_defaults(func=cmd_bench_prefill)
    fusion = benches.add_parser("fusion", help="chunk-reuse TTFT per method and tier, speedup over full, limit")
    add_fusion_arguments(fusion)
    fusion.set_defaults(func=run_fusion_bench)
    ttft = benches.add_parser("ttft", help="TTFT per method x tier x length x chunks, beside transformers and vLLM")
    add_ttft_arguments(ttft)
    ttft.set_defaults(func=run_ttft_bench)

    profile = commands.add_parser("profile", help="measure this machine and model for the controller and restoration")
    profiles = profile.add_subparsers(dest="profile", required=True)
    add_profile_commands(profiles)
    add_cache_commands(commands)
    add_restore_commands(profiles, benches)
    add_eval_commands(commands)
    add_analysis_commands(commands)
    add_serve_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ModelLoadError, UnsupportedModelError, ValueError, OSError) as e:
        print(f"kvreuse: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
