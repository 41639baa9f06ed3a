"""`kvreuse check-model [MODEL]`: the correctness gate a model must pass before reuse methods drive it."""

from __future__ import annotations

import argparse
import sys
import traceback

GATE_PROMPT = (
    "The KV cache of a transformer holds the keys and values of every token it has read. Reusing it for a "
    "document that appears again, even at a new position, saves recomputing the whole prefill."
)

# A CI script must tell a model that fails the gate from a gate that could not run on it.
PASSED, FAILED, CRASHED = 0, 1, 3  # 2: the model could not be loaded (kvreuse.cli.parser.main, as for every command)
EXIT_CODES = """exit codes:
  0  the model passes the gate
  1  the model fails the gate: a check differs from transformers (its FAIL line says how)
  2  no verdict: the model could not be loaded (missing, unreadable or truncated files, an unsupported architecture)
  3  no verdict: check-model crashed (a kvreuse bug; the traceback is printed)"""


def add_arguments(check: argparse.ArgumentParser) -> None:
    check.description = ("Compare kvreuse's runtime with transformers on the model, in fp32: prefill logits (whole "
                         "and continuing a cache), greedy decoding, pooled decoding of several sequences, re-rotated "
                         "keys.")
    check.epilog, check.formatter_class = EXIT_CODES, argparse.RawDescriptionHelpFormatter
    check.add_argument("model", nargs="?", default=None, help="HF directory or .gguf file (default: embedded model)")
    check.set_defaults(func=cmd_check_model)


def cmd_check_model(args: argparse.Namespace) -> int:
    from kvreuse.model.adapters import UnsupportedModelError
    from kvreuse.model.loader import ModelLoadError

    try:
        return _check_model(args.model)
    except (ModelLoadError, UnsupportedModelError, OSError):
        raise  # the model could not be loaded: its message and exit code 2 (kvreuse.cli.parser.main)
    except Exception:  # anything else is no verdict either, and must not read as the gate's FAIL (exit 1)
        traceback.print_exc()
        print(f"kvreuse: error: check-model crashed on {args.model or 'the embedded model'} before a verdict "
              f"(a kvreuse bug, not a gate failure)", file=sys.stderr)
        return CRASHED


def _check_model(model: str | None) -> int:
    from kvreuse.engine.generate import eos_token_ids
    from kvreuse.model.check import core_length, gate_prompt_ids, int8_decoding_drift, run_gate
    from kvreuse.model.loader import load_model

    loaded = load_model(model, "float32")
    prompt_ids = gate_prompt_ids(loaded.runtime, lambda text: loaded.tokenizer(text).input_ids, GATE_PROMPT)
    results = run_gate(loaded.runtime, prompt_ids, eos_token_ids(loaded))
    for result in results:
        print(f"{'PASS' if result.passed else 'FAIL'}  {result.name}: {result.detail}")
    print(f"INFO  {int8_decoding_drift(loaded.runtime, prompt_ids[:core_length(loaded.runtime)])}")
    passed = all(r.passed for r in results)
    print(f"{loaded.name}: {'passes' if passed else 'FAILS'} the correctness gate")
    return PASSED if passed else FAILED
