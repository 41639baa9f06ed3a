"""`kvreuse profile costs | fidelity | l-delta`: measure this machine and model for the controller and restoration."""

from __future__ import annotations

import argparse
import functools
import tempfile
from pathlib import Path

from kvreuse.bench.tiers import check_tiers
from kvreuse.cli.arguments import add_dtype, add_model, checked_by, output_file, positive_int
from kvreuse.cli.bench import add_restore_arguments

DEFAULT_TIERS = "memory,disk,ssd,hdd"


def cmd_costs(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvreuse.bench.tiers import tier_spec
    from kvreuse.controller.measure import measure_profile
    from kvreuse.controller.profile import load_profile, merged, save_profile
    from kvreuse.controller.report import profile_table
    from kvreuse.model.loader import load_model
    from kvreuse.store.spec import open_store

    loaded = load_model(args.model, args.dtype)
    saved = load_profile(loaded.fingerprint, args.dtype, args.out)
    with tempfile.TemporaryDirectory(prefix="kvreuse-profile-", dir="/var/tmp") as scratch:
        stores = {tier: open_store(tier_spec(tier, scratch), model_fingerprint=loaded.fingerprint, dtype=args.dtype)
                  for tier in args.tiers}
        profile = measure_profile(loaded.runtime, loaded.fingerprint, args.dtype, stores, args.repeats)
        if saved is not None:
            profile = merged(saved, profile)
            kept = sorted(set(saved.tiers) - set(stores))
            if kept or saved.tuned_ratios:
                print(f"kept from the saved profile: tiers {', '.join(kept) or 'none'}; tuned ratios "
                      f"{', '.join(f'{k} {r:g}' for k, r in sorted(saved.tuned_ratios.items())) or 'none'}")
        if args.calibrate:
            profile = _calibrate(loaded, stores, profile, args.calibration_repeats)
        for store in stores.values():
            store.close()
    path = save_profile(profile, args.out)
    Console(width=140).print(profile_table(profile, loaded.name))
    print(f"saved to {path}")
    return 0


def _calibrate(loaded, stores: dict, profile, repeats: int):
    from kvreuse.controller.auto import AutoController
    from kvreuse.controller.calibrate import cacheblend_rule, calibrated, mean_ttft, synthetic_requests, tune_cachetune
    from kvreuse.controller.fidelity import load_table
    from kvreuse.engine.reuse import ReuseEngine

    for tier, store in stores.items():
        engine = ReuseEngine(loaded, store, controller=AutoController(profile, load_table(loaded.fingerprint)))
        requests = synthetic_requests(engine.build_request, loaded.tokenizer)
        for request in requests:
            engine.compile(request, ["cachetune"])
        objective = mean_ttft(lambda request, method: engine.prefill(request, method).ttft, requests, repeats)
        cachetune = tune_cachetune(objective, profile, tier)
        cacheblend = cacheblend_rule(lambda method: engine.plan_on_tiers(requests[0], method), profile)
        profile = calibrated(profile, tier, cachetune, cacheblend)
    return profile


def cmd_fidelity(args: argparse.Namespace) -> int:
    from kvreuse.controller.fidelity import from_eval_results, save_table, user_table_path

    inputs = [Path(p) / "results.json" if Path(p).is_dir() else Path(p) for p in args.results]
    table = from_eval_results(inputs)
    path = args.out or user_table_path(table.model)
    if path.exists() and not args.replace and path.resolve() not in {p.resolve() for p in inputs}:
        # Replaced, the table would lose the worst cases of the datasets it was folded from, and auto admit
        # methods past its floor on them.
        raise ValueError(f"{path} holds a fidelity table already: give it among the inputs to fold these results "
                         "into it, or --replace to start a new one")
    save_table(table, path)
    for method, fidelity in sorted(table.methods.items(), key=lambda mf: mf[1].first_token_kl):
        print(f"{method:>18}: first-token KL {fidelity.first_token_kl:.3f}, agreement {fidelity.agreement:.3f} "
              f"({fidelity.examples} examples)")
    print(f"saved to {path}")
    return 0


def cmd_l_delta(args: argparse.Namespace) -> int:
    from kvreuse.bench.restore import run_profile

    run_profile(args.layers or None, args.tiers, args.lengths, args.repeats, args.block, args.threads,
                args.compute_run)
    return 0


def add_arguments(profile: argparse.ArgumentParser) -> None:
    kinds = profile.add_subparsers(dest="profile", required=True)
    costs = kinds.add_parser("costs", help="the controller's machine profile: compute per layer, reads per tier")
    add_model(costs)
    add_dtype(costs)
    costs.add_argument("--tiers", type=checked_by(functools.partial(check_tiers, redis=False)), default=DEFAULT_TIERS,
                       help="tiers to profile, comma-separated "
                       "(memory, disk, or the emulated ssd, hdd, net10g)")
    costs.add_argument("--repeats", type=positive_int, default=5, help="timings per figure (their median is kept)")
    costs.add_argument("--calibrate", action="store_true",
                       help="also choose each tier's CacheTune ratio (golden-section search over measured TTFT) "
                            "and CacheBlend's load-hiding ratio")
    costs.add_argument("--calibration-repeats", type=positive_int, default=2)
    costs.add_argument("--out", type=output_file, default=None,
                       help="profile file (default: in the kvreuse cache folder)")
    costs.set_defaults(func=cmd_costs)

    fidelity = kinds.add_parser("fidelity", help="the model's fidelity table for method auto, from eval results")
    fidelity.add_argument("results", nargs="+", help="kvreuse eval output folders (or their results.json), and "
                          "earlier fidelity tables to fold in")
    fidelity.add_argument("--out", type=output_file, default=None,
                          help="table file (default: in the kvreuse cache folder)")
    fidelity.add_argument("--replace", action="store_true",
                          help="replace the table there (by default it must be among the inputs, to fold into)")
    fidelity.set_defaults(func=cmd_fidelity)

    l_delta = kinds.add_parser("l-delta", help="CacheFlow's L_delta (layer-wise vs token-wise restoration) per tier")
    add_restore_arguments(l_delta, [256, 512, 1024, 2048], 3, layers=0)  # what the engine reads
    l_delta.set_defaults(func=cmd_l_delta)
