"""`kvreuse check-model [MODEL]`: the correctness gate a model must pass before reuse methods drive it."""

from __future__ import annotations

import argparse

GATE_PROMPT = (
    "The KV cache of a transformer holds the keys and values of every token it has read. Reusing it for a "
    "document that appears again, even at a new position, saves recomputing the whole prefill."
)


def add_commands(commands: argparse._SubParsersAction) -> None:
    check = commands.add_parser("check-model", help="run the correctness gate on a model")
    check.add_argument("model", nargs="?", default=None, help="HF directory or .gguf file (default: embedded model)")
    check.set_defaults(func=cmd_check_model)


def cmd_check_model(args: argparse.Namespace) -> int:
    from kvreuse.engine.generate import eos_token_ids
    from kvreuse.model.check import gate_prompt_ids, int8_decoding_drift, run_gate
    from kvreuse.model.loader import load_model

    loaded = load_model(args.model, "float32")
    prompt_ids = gate_prompt_ids(loaded.runtime, lambda text: loaded.tokenizer(text).input_ids, GATE_PROMPT)
    results = run_gate(loaded.runtime, prompt_ids, eos_token_ids(loaded))
    for result in results:
        print(f"{'PASS' if result.passed else 'FAIL'}  {result.name}: {result.detail}")
    print(f"INFO  {int8_decoding_drift(loaded.runtime, prompt_ids)}")
    passed = all(r.passed for r in results)
    print(f"{loaded.name}: {'passes' if passed else 'FAILS'} the correctness gate")
    return 0 if passed else 1
