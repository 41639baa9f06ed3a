"""CacheTune's frequency-domain observations, measured on this model.

`spectrum` (CacheTune Fig. 2): how the energy of each chunk's K and V, seen as a signal along the tokens, spreads
over frequencies; the paper reports most of it in the lowest 20%. Measured on the stored form CacheTune ranks
(keys before RoPE), on keys after RoPE as attention sees them, and with each feature's mean (the DC bin) removed.

`frequency-selection` (CacheTune Fig. 10, and why CacheTune barely beats naive reuse here): at one recompute
ratio, tokens chosen by low-frequency score, high-frequency score and at random, beside the variants DESIGN.md
asks about (a ranking over the concatenated context, V-only scores, per-layer sets, selection by the question's
attention) and the oracles (highest true KV deviation, the question's attention in full prefill).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable

import torch

from kvreuse.eval.analyses.deviation import random_rows, spearman, top_rows
from kvreuse.eval.analyses.output import AnalysisSettings
from kvreuse.eval.analyses.probe import ExampleProbe
from kvreuse.fusion.compile import band_norms, layer_averaged_ranking

BANDS = 10  # equal-width frequency bands from 0 to Nyquist
LOW_BANDS = 2  # the lowest 20% of frequencies


def band_energy(signal: torch.Tensor, bands: int = BANDS, remove_mean: bool = False) -> torch.Tensor:
    """Share of a signal's energy in each of `bands` equal-width frequency bands, [bands], summing to 1.

    `signal` is [tokens, features], transformed along the tokens. The rFFT's one-sided bins are weighted so that
    the energies add up to the signal's (Parseval): every bin but DC and Nyquist stands for two of the full FFT.
    """
    x = signal.double()
    if remove_mean:
        x = x - x.mean(0)
    n = x.shape[0]
    power = torch.fft.rfft(x, dim=0).abs().square().sum(1)
    weight = torch.full_like(power, 2.0)
    weight[0] = 1.0
    if n % 2 == 0:
        weight[-1] = 1.0
    energy = power * weight
    band = (torch.arange(power.numel()) * bands // power.numel()).clamp_max(bands - 1)
    per_band = torch.zeros(bands, dtype=torch.float64).index_add_(0, band, energy)
    return per_band / per_band.sum().clamp_min(1e-300)


def _chunk_signals(probe: ExampleProbe) -> dict[str, list[torch.Tensor]]:
    """Per signal kind, one [layers, tokens, features] tensor per chunk."""
    kinds = ("K (stored, before RoPE)", "V", "K after RoPE (in the prompt)")
    signals: dict[str, list[torch.Tensor]] = {kind: [] for kind in kinds}
    for chunk in probe.chunks:
        keys, values = probe.stored_kv(chunk)
        rows = slice(chunk.start, chunk.start + len(chunk.token_ids))
        signals["K (stored, before RoPE)"].append(keys.flatten(2))
        signals["V"].append(values.flatten(2))
        signals["K after RoPE (in the prompt)"].append(torch.stack([k[rows] for k in probe.full.cache.keys]).flatten(2))
    return signals


def spectrum(probes: Iterable[ExampleProbe], settings: AnalysisSettings) -> dict:
    """Per signal kind: the low-20% energy share per layer, and the energy per band averaged over layers, with and
    without the DC bin; averaged over every chunk of every example."""
    per_kind: dict[str, list[torch.Tensor]] = {}  # kind -> [layers, bands] per chunk
    chunks_seen = 0
    for probe in probes:
        chunks_seen += len(probe.chunks)
        for kind, chunks in _chunk_signals(probe).items():
            for chunk in chunks:
                for remove_mean in (False, True):
                    name = f"{kind}, mean removed" if remove_mean else kind
                    energy = torch.stack([band_energy(layer, remove_mean=remove_mean) for layer in chunk])
                    per_kind.setdefault(name, []).append(energy)
    result = {}
    for name, energies in per_kind.items():
        mean = torch.stack(energies).mean(0)  # [layers, bands]
        result[name] = {
            "low20_share_per_layer": mean[:, :LOW_BANDS].sum(1).tolist(),
            "low20_share_mean": float(mean[:, :LOW_BANDS].sum(1).mean()),
            "band_share_mean": mean.mean(0).tolist(),
        }
    return {"bands": BANDS, "chunks": chunks_seen, "signals": result}


def draw_spectrum(figure, numbers: dict) -> None:
    by_layer, by_band = figure.subplots(1, 2)
    for i, (name, signal) in enumerate(numbers["signals"].items()):
        style = {"color": f"C{i // 2}", "linestyle": "--" if "mean removed" in name else "-"}
        by_layer.plot(signal["low20_share_per_layer"], label=name, **style)
        bands = [f"{10 * b}-{10 * b + 10}%" for b in range(numbers["bands"])]
        by_band.plot(bands, signal["band_share_mean"], marker="o", **style)
    by_layer.set_xlabel("layer")
    by_layer.set_ylabel("share of energy in the lowest 20% of frequencies")
    by_layer.set_ylim(0, 1.02)
    by_layer.legend(fontsize=8)
    by_band.set_xlabel("frequency band (share of 0..Nyquist)")
    by_band.set_ylabel("share of energy (mean over layers)")
    by_band.set_yscale("log")
    by_band.tick_params(axis="x", labelsize=7, rotation=45)
    for ax in (by_layer, by_band):
        ax.grid(alpha=0.3)
    figure.suptitle("CacheTune Fig. 2 on SmolLM2-135M: spectral energy of each chunk's KV along its tokens")


# ---- selections at one ratio ---------------------------------------------------------------------------


def _per_chunk(probe: ExampleProbe, score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], ratio: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top `ratio` of each chunk by `score(stored K, stored V)` -> (rows, the scores of every chunk row)."""
    rows, scores = [], []
    for chunk in probe.chunks:
        chunk_score = score(*probe.stored_kv(chunk))
        rows.append(top_rows(chunk_score, torch.arange(chunk.start, chunk.start + len(chunk.token_ids)), ratio))
        scores.append(chunk_score)
    return torch.cat(rows), torch.cat(scores)


def _concatenated_low_frequency(probe: ExampleProbe) -> torch.Tensor:
    """CacheTune's score over all chunks' stored KV laid end to end, as if the context were one signal."""
    stored = [probe.stored_kv(c) for c in probe.chunks]
    keys, values = torch.cat([k for k, _ in stored], dim=1), torch.cat([v for _, v in stored], dim=1)
    return layer_averaged_ranking(band_norms(keys, values).mean(0))


def _query_attention(probe: ExampleProbe, attention: list[torch.Tensor]) -> torch.Tensor:
    """Attention the fresh rows put on each chunk row, averaged over layers, heads and rows."""
    return torch.stack([a.mean((0, 1)) for a in attention]).mean(0)[probe.chunk_rows]


def _selections(probe: ExampleProbe, naive_attention: list[torch.Tensor], deviation: torch.Tensor, ratio: float,
                generator: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Name -> (chunk rows to recompute, the score they were ranked by, one per chunk row, if any)."""
    low = _per_chunk(probe, lambda k, v: layer_averaged_ranking(band_norms(k, v).mean(0)), ratio)
    concatenated = _concatenated_low_frequency(probe)
    asked_naive = _query_attention(probe, naive_attention)
    asked_full = _query_attention(probe, probe.full.attention)
    rows = probe.chunk_rows
    lengths = [len(c.token_ids) for c in probe.chunks]
    return {
        "random": (random_rows(rows, ratio, generator), None),
        "low-frequency (CacheTune)": low,
        "high-frequency": _per_chunk(probe, lambda k, v: layer_averaged_ranking(band_norms(k, v, band="high").mean(0)),
                                     ratio),
        # does the sink CacheTune's score never picks explain its gap? the same set plus one token per chunk
        "low-frequency + each chunk's first token": (torch.cat([low[0], probe.chunk_starts()]).unique(), None),
        "low-frequency, V only": _per_chunk(probe, lambda k, v: layer_averaged_ranking(band_norms(k, v)[1]), ratio),
        "low-frequency, concatenated context": (top_rows(concatenated, rows, ratio), concatenated),
        "first tokens of each chunk": (
            torch.cat([c.start + torch.arange(round(ratio * n)) for c, n in zip(probe.chunks, lengths)]), None
        ),
        "question's attention, naive reuse": (top_rows(asked_naive, rows, ratio), asked_naive),
        "question's attention, full (oracle)": (top_rows(asked_full, rows, ratio), asked_full),
        "HKVD (oracle)": (top_rows(deviation.sum(0), rows, ratio), deviation.sum(0)),
    }


def _per_layer_precision(probe: ExampleProbe, deviation: torch.Tensor, ratio: float) -> dict[str, list[float]]:
    """Per layer, the share of a selection that is in that layer's own HKVD set: for per-layer low-frequency
    sets (CacheTune's Eq. 7 taken per layer) and for the one layer-averaged set the engine uses."""
    stored = [probe.stored_kv(c) for c in probe.chunks]
    per_layer_scores = torch.cat([band_norms(k, v).mean(0) for k, v in stored], dim=1)  # [layers, chunk rows]
    averaged = torch.cat([layer_averaged_ranking(band_norms(k, v).mean(0)) for k, v in stored])
    offsets = torch.tensor([0] + [k.shape[1] for k, _ in stored]).cumsum(0)
    positions = torch.arange(probe.chunk_rows.numel())

    def per_chunk_top(score: torch.Tensor) -> set[int]:
        return {int(i) for a, b in zip(offsets, offsets[1:]) for i in top_rows(score[a:b], positions[a:b], ratio)}

    averaged_set = per_chunk_top(averaged)
    result: dict[str, list[float]] = {"per-layer low-frequency set": [], "layer-averaged low-frequency set": []}
    for layer in range(1, deviation.shape[0]):  # layer 0 has no deviation to match
        hkvd = set(top_rows(deviation[layer], positions, ratio).tolist())
        own = per_chunk_top(per_layer_scores[layer])
        result["per-layer low-frequency set"].append(len(own & hkvd) / max(1, len(own)))
        result["layer-averaged low-frequency set"].append(len(averaged_set & hkvd) / max(1, len(averaged_set)))
    return result


def _chunk_start_profile(probe: ExampleProbe) -> dict[str, float]:
    """How a chunk's first token (its sink under naive reuse) looks to a norm-based score: its stored K and V
    norms against the chunk's other tokens (mean over layers and chunks), and its percentile in CacheTune's
    score (the share of the chunk's other tokens scoring lower; 0: last)."""
    def percentile(score: torch.Tensor) -> float:
        return float((score[1:] < score[0]).float().mean())

    profile: dict[str, list[float]] = {}
    for chunk in probe.chunks:
        keys, values = probe.stored_kv(chunk)
        k_norm, v_norm = keys.flatten(2).float().norm(dim=2), values.flatten(2).float().norm(dim=2)  # [layers, n]
        filtered = layer_averaged_ranking(band_norms(keys, values).mean(0))
        unfiltered = layer_averaged_ranking((k_norm + v_norm) / 2)  # the same score without the low-pass filter
        for name, value in (("k_norm_vs_rest", float(k_norm[:, 0].mean() / k_norm[:, 1:].mean())),
                            ("v_norm_vs_rest", float(v_norm[:, 0].mean() / v_norm[:, 1:].mean())),
                            ("percentile_in_low_frequency_score", percentile(filtered)),
                            ("percentile_in_unfiltered_norm_score", percentile(unfiltered))):
            profile.setdefault(name, []).append(value)
    return {name: statistics.fmean(values) for name, values in profile.items()}


def frequency_selection(probes: Iterable[ExampleProbe], settings: AnalysisSettings) -> dict:
    generator = torch.Generator().manual_seed(settings.seed)
    ratio = settings.ratio
    measured: dict[str, list[dict]] = {}
    precision: dict[str, list[list[float]]] = {}
    chunk_start: list[dict] = []
    for probe in probes:
        chunk_start.append(_chunk_start_profile(probe))
        naive = probe.run_method("naive")
        deviation = probe.kv_deviation(naive)  # [layers, chunk rows]
        hkvd = set(top_rows(deviation.sum(0), probe.chunk_rows, ratio).tolist())
        starts = set(probe.chunk_starts().tolist())
        measured.setdefault("naive (r = 0)", []).append(probe.fidelity(naive))
        measured.setdefault(f"cachetune:{ratio} (the engine's method)", []).append(
            probe.fidelity(probe.run_method(f"cachetune:{ratio}")))
        measured.setdefault(f"cacheblend:{ratio} (the engine's method)", []).append(
            probe.fidelity(probe.run_method(f"cacheblend:{ratio}")))
        for name, (rows, score) in _selections(probe, naive.attention, deviation, ratio, generator).items():
            chosen = set(rows.tolist())
            record = probe.fidelity(probe.run_rows(rows))
            record["hkvd_precision"] = len(chosen & hkvd) / max(1, len(chosen))
            record["chunk_starts_covered"] = len(chosen & starts) / len(starts)
            if score is not None:
                record["spearman_with_kv_deviation"] = spearman(score, deviation.sum(0))
            measured.setdefault(name, []).append(record)
        for name, values in _per_layer_precision(probe, deviation, ratio).items():
            precision.setdefault(name, []).append(values)
    return {
        "ratio": ratio,
        "selections": {name: _mean_records(records) for name, records in measured.items()},
        "per_layer_hkvd_precision": {n: [statistics.fmean(v) for v in zip(*runs)] for n, runs in precision.items()},
        "chunk_first_token": _mean_records(chunk_start),
    }


def _mean_records(records: list[dict]) -> dict[str, float]:
    return {key: statistics.fmean(r[key] for r in records) for key in records[0]}


def draw_frequency_selection(figure, numbers: dict) -> None:
    kl, attention, layers = figure.subplots(1, 3, width_ratios=[1, 1, 1.1])
    names = list(numbers["selections"])
    for ax, metric, label in ((kl, "first_token_kl", "first-token KL from full (nats)"),
                              (attention, "attention_deviation", "attention deviation from full")):
        values = [numbers["selections"][n][metric] for n in names]
        colors = ["C3" if "oracle" in n else "C0" if "frequency" in n or "cachetune" in n else "0.5" for n in names]
        ax.barh(range(len(names)), values, color=colors)
        ax.set_yticks(range(len(names)), names if ax is kl else [], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(label)
        ax.grid(alpha=0.3, axis="x")
    for name, values in numbers["per_layer_hkvd_precision"].items():
        layers.plot(range(1, len(values) + 1), values, marker=".", label=name)
    layers.axhline(numbers["ratio"], color="0.5", linestyle=":", label="random (expected)")
    layers.set_xlabel("layer")
    layers.set_ylabel("share of the set in the layer's HKVD set")
    layers.set_ylim(0, 1)
    layers.legend(fontsize=8)
    layers.grid(alpha=0.3)
    figure.suptitle(f"CacheTune Fig. 10 on SmolLM2-135M: which tokens to recompute at r = {numbers['ratio']} "
                    "(red: oracles, blue: frequency scores)")
