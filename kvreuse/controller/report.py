"""The machine profile as a table: what `kvreuse profile costs` prints."""

from __future__ import annotations

from rich.table import Table

from kvreuse.controller.calibrate import RATIO_FLOOR
from kvreuse.controller.profile import MachineProfile
from kvreuse.controller.search import roofline_ratio


def profile_table(profile: MachineProfile, model_name: str) -> Table:
    compute = profile.compute
    causal = compute.causal_seconds_per_score
    table = Table(title=f"Machine profile, {model_name} ({profile.dtype}), {profile.measured_at}: "
                        f"t_c {compute.t_c * 1e6:.1f} us/token/layer, t_o {compute.t_o * 1e3:.2f} ms/layer, "
                        f"attention {compute.score_seconds * 1e9:.2f} ns/score ({causal * 1e9:.2f} causal) "
                        f"+ {compute.key_seconds * 1e9:.0f} ns/key + {compute.call_seconds * 1e6:.0f} us/call, "
                        f"place {compute.place_seconds * 1e9:.0f} ns/row")
    for column in ("tier", "read GB/s", "latency (ms)", "t_i (us/token/layer)", "roofline r0", "CacheTune ratio",
                   "CacheBlend ratio"):
        table.add_column(column, justify="right")
    for name, tier in profile.tiers.items():
        tuned = [profile.tuned_ratios.get(f"{method}@{name}") for method in ("cachetune", "cacheblend")]
        table.add_row(f"{name} (emulated)" if tier.emulated else name, f"{tier.bytes_per_second / 1e9:.2f}",
                      f"{tier.latency_seconds * 1e3:.3f}", f"{profile.t_i(name) * 1e6:.3f}",
                      f"{roofline_ratio(compute.t_c, profile.t_i(name), floor=RATIO_FLOOR):.3f}",
                      *("-" if r is None else f"{r:.3f}" for r in tuned))
    return table
