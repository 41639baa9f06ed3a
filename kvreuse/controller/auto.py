"""`method: auto`: per request, the fastest plan whose expected fidelity meets the user's quality floor.

No paper picks among methods: CacheBlend tunes its ratio to the device, CacheTune its ratio by search, Cake
needs no tuning. Here every method and ratio the model's fidelity table admits under the floor (plus the exact
plan, which always qualifies) is planned against what the store holds for this request, the cost model
predicts each plan's TTFT on this machine, and the fastest wins. Plans predicted within `tie_tolerance` of the
fastest are a tie, and a tie goes to the more faithful plan: when loading dominates, recomputing more costs
nothing (CacheBlend's rule, ratio = max(ratio that hides the load, floor), falls out of this).
The exact prefix is never part of the choice: it is restored exactly (Cake/CacheFlow) before planning.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from kvreuse.controller.cost import Prediction, predict
from kvreuse.controller.fidelity import EXACT, Fidelity, FidelityTable, choosable
from kvreuse.controller.profile import MachineProfile
from kvreuse.fusion.methods import Auto
from kvreuse.fusion.plan import FusionPlan

log = logging.getLogger(__name__)
TIE_TOLERANCE = 0.03
# a method whose parameter the profile tunes per tier (kvreuse profile --calibrate): tried at the tuned value
TUNABLE = ("cacheblend", "cachetune")

PlanFor = Callable[[str], tuple[FusionPlan, list[str]]]  # method -> its plan for this request, tier of each span


@dataclass(frozen=True)
class Candidate:
    method: str
    fidelity: Fidelity
    prediction: Prediction


@dataclass(frozen=True)
class Choice:
    method: str
    candidates: list[Candidate]  # every plan considered, fastest first

    @property
    def predicted_seconds(self) -> float:
        return next(c.prediction.seconds for c in self.candidates if c.method == self.method)


def meets(fidelity: Fidelity, floor: Auto) -> bool:
    return ((floor.max_kl is None or fidelity.first_token_kl <= floor.max_kl)
            and (floor.min_agreement is None or fidelity.agreement >= floor.min_agreement))


class AutoController:
    def __init__(self, profile: MachineProfile, table: FidelityTable | None, tie_tolerance: float = TIE_TOLERANCE):
        self.profile, self.table, self.tie_tolerance = profile, table, tie_tolerance
        if table is None:
            log.warning("no fidelity table for model %s: method auto can only choose exact plans", profile.model)

    def admitted(self, floor: Auto, tier: str | None = None) -> dict[str, Fidelity]:
        """The methods whose expected fidelity meets `floor`: the table's, each tuned ratio of `tier`, exact."""
        known = dict(self.table.methods) if self.table else {}
        for name in TUNABLE:
            ratio = self.profile.tuned_ratios.get(f"{name}@{tier}")
            if ratio is not None and self.table and (fidelity := self.table.of(f"{name}:{ratio:g}")):
                known[f"{name}:{ratio:g}"] = fidelity
        known[EXACT] = Fidelity(0.0, 1.0)
        return {m: f for m, f in known.items() if m != "full" and choosable(m) and meets(f, floor)}

    def choose(self, floor: Auto, plan_for: PlanFor) -> Choice:
        tier = _main_tier(*plan_for("naive"))
        candidates = sorted(
            (Candidate(m, f, predict(*plan_for(m), self.profile)) for m, f in self.admitted(floor, tier).items()),
            key=lambda c: c.prediction.seconds)
        fastest = candidates[0].prediction.seconds
        ties = [c for c in candidates if c.prediction.seconds <= fastest * (1 + self.tie_tolerance)]
        best = min(ties, key=lambda c: (c.fidelity.first_token_kl, -c.fidelity.agreement, c.prediction.seconds))
        return Choice(best.method, candidates)


def _main_tier(plan: FusionPlan, span_tiers: list[str]) -> str | None:
    """The tier that serves most of the plan's loaded rows."""
    rows: Counter[str] = Counter()
    for span, tier in zip(plan.reused, span_tiers):
        rows[tier] += int(span.load.numel())
    return rows.most_common(1)[0][0] if rows else None
