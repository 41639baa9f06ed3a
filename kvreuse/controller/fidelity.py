"""What each method and ratio is expected to cost in quality, for one model: the eval's measured fidelity.

`kvreuse profile fidelity RESULTS_DIR...` turns `kvreuse eval` outputs (and earlier tables) into a table; where several
datasets measured a method, the table keeps the worst of them (highest first-token KL, lowest agreement), so
a floor met by the table is met on each of them. The embedded model's table ships with the package
(`kvreuse/controller/fidelity/`); tables made for other models go to the kvreuse cache folder.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from kvreuse.fusion.methods import Auto, parse_method
from kvreuse.model.identity import cache_root, save_json

log = logging.getLogger(__name__)

EXACT = "prefix"  # exact prefix restored, every chunk recomputed: full prefill's output, always available
EXACT_METHODS = (EXACT, "full")


@dataclass(frozen=True)
class Fidelity:
    first_token_kl: float  # nats, from full prefill's first-token distribution
    agreement: float  # token F1 between the method's output and full prefill's
    examples: int = 0

    def __post_init__(self) -> None:
        # What method auto compares with a floor: a value of another kind (a table edited or written by hand) is
        # refused where it is read, not met as a TypeError by every later request.
        if not _number(self.first_token_kl) or not self.first_token_kl >= 0:
            raise ValueError(f"first_token_kl: expected a number >= 0, got {self.first_token_kl!r}")
        if not _number(self.agreement) or not 0 <= self.agreement <= 1:
            raise ValueError(f"agreement: expected a number in [0, 1], got {self.agreement!r}")
        if type(self.examples) is not int or self.examples < 0:
            raise ValueError(f"examples: expected a whole number >= 0, got {self.examples!r}")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class FidelityTable:
    model: str  # fingerprint
    methods: dict[str, Fidelity]
    sources: list[str] = field(default_factory=list)  # the eval runs it was built from

    def __post_init__(self) -> None:
        if not isinstance(self.model, str):
            raise ValueError(f"model: expected a fingerprint, got {self.model!r}")
        if not isinstance(self.sources, list) or not all(isinstance(s, str) for s in self.sources):
            raise ValueError(f"sources: expected a list of texts, got {self.sources!r}")

    def of(self, method: str) -> Fidelity | None:
        """The method's measured fidelity; for a ratio that was not measured, the fidelity of the largest
        measured ratio below it (a conservative guess: recomputing more never made a method worse on the eval);
        exact methods are exact."""
        return expected_fidelity(self, method)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> FidelityTable:
        try:
            methods = {m: Fidelity(**f) for m, f in data["methods"].items()}
            return cls(data["model"], _choosable_only(methods), data.get("sources", []))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"not a kvreuse fidelity table: {e}") from None


def choosable(method: str) -> bool:
    """Whether method auto can plan `method`: a fixed method at the engine's own dtype, not auto itself nor an
    eval's METHOD@VARIANT (another dtype or decoding)."""
    if "@" in method:
        return False
    try:
        return not isinstance(parse_method(method), Auto)
    except ValueError:
        return False


def _choosable_only(methods: dict[str, Fidelity]) -> dict[str, Fidelity]:
    skipped = sorted(set(methods) - {m for m in methods if choosable(m)})
    if skipped:
        log.info("fidelity table: left out %s (method auto cannot choose them)", ", ".join(skipped))
    return {m: f for m, f in methods.items() if m not in skipped}


# Families whose number is what a request leaves unrecomputed (a guard's residual): a larger one recomputes less.
FEWER_ROWS_AS_IT_GROWS = ("guarded", "guarded-query")


def expected_fidelity(table: FidelityTable | None, method: str) -> Fidelity | None:
    """What `method` is expected to reach: exact methods are exact whatever the model; the others are what the
    model's table measured (None without a table, or for a method it never measured)."""
    if method in EXACT_METHODS:
        return Fidelity(0.0, 1.0)
    if table is None:
        return None
    if method in table.methods:
        return table.methods[method]
    name, _, arg = method.partition(":")
    try:
        ratio = float(arg)
    except ValueError:
        return None
    # An unmeasured number takes the nearest measured one that recomputes no more: never a more faithful setting.
    measured = [(r, f) for m, f in table.methods.items() if (r := _ratio_of(m, name)) is not None]
    if name in FEWER_ROWS_AS_IT_GROWS:
        above = [(r, f) for r, f in measured if r >= ratio]
        return min(above, key=lambda rf: rf[0])[1] if above else None
    below = [(r, f) for r, f in measured if r <= ratio]
    return max(below, key=lambda rf: rf[0])[1] if below else None


def _ratio_of(method: str, family: str) -> float | None:
    name, _, arg = method.partition(":")
    try:
        return float(arg) if name == family and arg else None
    except ValueError:
        return None


def from_eval_results(paths: list[Path]) -> FidelityTable:
    """The worst fidelity of each method over the inputs: `kvreuse eval` result files (results.json) and earlier
    fidelity tables (so a new dataset's results fold into a table whose eval outputs are gone)."""
    tables = [_read_table(Path(path)) for path in paths]
    models = {table.model for table in tables}
    if len(models) != 1:
        raise ValueError(f"eval results of {len(models)} models given ({', '.join(sorted(models))}); "
                         "one table per model")
    worst: dict[str, Fidelity] = {}
    sources: list[str] = []
    for table in tables:
        # An input whose every source is in already (a table folded again, a second run of the same examples with
        # other methods) measured the same examples: they count once.
        seen = bool(table.sources) and set(table.sources) <= set(sources)
        for method, new in table.methods.items():
            old = worst.get(method)
            worst[method] = new if old is None else Fidelity(
                max(old.first_token_kl, new.first_token_kl), min(old.agreement, new.agreement),
                max(old.examples, new.examples) if seen else old.examples + new.examples)
        sources += [source for source in table.sources if source not in sources]
    return FidelityTable(models.pop(), worst, sources)


def _read_table(path: Path) -> FidelityTable:
    try:
        return _as_table(json.loads(path.read_text()))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


def _as_table(data: object) -> FidelityTable:
    """One eval run (results.json: a list of method rows) or a fidelity table (a dict of methods) as a table."""
    if not isinstance(data, dict):
        raise ValueError(f"neither kvreuse eval results nor a fidelity table: a JSON {type(data).__name__}")
    if isinstance(data.get("methods"), dict):
        return FidelityTable.from_json(data)
    short = _runs_missing_chunks(data.get("examples"))
    if short:
        raise ValueError(f"{short} runs found fewer of their chunks stored than were compiled (the eval's --store was "
                         "too small for an example): their fidelity is partly full prefill's, and a table of it would "
                         "promise more than the method keeps; run the eval again with a larger --store")
    try:
        methods = {row["method"]: _fidelity_of(row) for row in data["methods"]}
        source = f"{data['settings']['dataset']}: {data['methods'][0]['examples']} examples"
        return FidelityTable(data["settings"]["model"], _choosable_only(methods), [source])
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise ValueError(f"neither kvreuse eval results nor a fidelity table: {e}") from None


def _runs_missing_chunks(examples: object) -> int:
    """How many of an eval's per-example rows read fewer chunks than their example holds (as the eval warns)."""
    stats = [row.get("stats") for row in examples if isinstance(row, dict)] if isinstance(examples, list) else []
    return sum(isinstance(s, dict) and s.get("chunk_hits", 0) < s.get("chunks", 0) for s in stats)


def _fidelity_of(row: dict) -> Fidelity:
    try:
        return Fidelity(row["first_token_kl"], row["agreement"], row["examples"])
    except ValueError as e:
        raise ValueError(f"method {row.get('method')!r}: {e}") from None


def user_table_path(model: str) -> Path:
    return cache_root() / "controller" / f"fidelity-{model}.json"


def _shipped_tables() -> list[dict]:
    folder = resources.files("kvreuse.controller") / "fidelity"
    return [json.loads(f.read_text()) for f in folder.iterdir() if f.name.endswith(".json")]


def load_table(model: str) -> FidelityTable | None:
    """The model's table: one made on this machine first, else one shipped with the package, else None."""
    path = user_table_path(model)
    try:
        return FidelityTable.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        log.warning("fidelity table %s is unreadable (%s): using the shipped one, if any", path, e)
    shipped = [t for t in _shipped_tables() if t.get("model") == model]
    return FidelityTable.from_json(shipped[0]) if shipped else None


def save_table(table: FidelityTable, path: Path) -> Path:
    return save_json(path, table.to_json())
