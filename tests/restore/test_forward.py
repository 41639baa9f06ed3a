"""Batched compute steps: several requests' runs through one `forward` (projections and MLP over all their rows
at once, attention per request) give the KV and first-token logits that the same runs give one request at a
time, on both axes and on a mix of them, within 1e-4."""

from __future__ import annotations

import pytest
import torch

from kvreuse.restore import PrefixRestorer
from kvreuse.restore.job import JobAxis, LayerAxis, PrefixJob, TokenAxis, forward
from kvreuse.restore.restorer import as_ids
from kvreuse.restore.units import Span
from kvreuse.store import KeySpace, open_store

from .support import restore_split

TOLERANCE = dict(atol=1e-4, rtol=0)
# (prompt, stored prefix): prefixes of different lengths, so that layer-axis runs of different requests are on
# different layers in the same step, and token-axis runs are at different positions.
PROMPTS = [(45, 40), (30, 16), (37, 24)]


def jobs_of(model, seed: int) -> list[PrefixJob]:
    restorer = PrefixRestorer(model, open_store("memory:64MB"), KeySpace("tiny", "tok"), block_size=8)
    jobs = []
    for i, (n, stored) in enumerate(PROMPTS):
        ids = torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed + i)).tolist()
        restorer.store_prefix(ids[:stored])
        token_ids = as_ids(ids, model.device)
        jobs.append(restorer.new_job(token_ids, restorer.blocks_to_restore(token_ids)))
    return jobs


def compute_together(axes: list[JobAxis], size: int) -> None:
    """Every axis's positions computed from the front, each step one span of every axis with some left, all
    through one forward."""
    fronts = [0] * len(axes)
    while work := [(axis, Span(f, axis.compute_stop(f, size, axis.length)))
                   for axis, f in zip(axes, fronts) if f < axis.length]:
        for (axis, span), hidden in zip(work, forward([axis.run(span) for axis, span in work])):
            axis.ran(span, hidden)
            fronts[axes.index(axis)] = span.stop


def remainders(jobs: list[PrefixJob]) -> list[torch.Tensor]:
    """Each prompt after its prefix through one forward: first-token logits."""
    outputs = forward([job.run(slice(job.prefix_length, len(job.token_ids))) for job in jobs])
    return [job.model.logits(hidden[-1:])[0] for job, hidden in zip(jobs, outputs)]


@pytest.mark.parametrize("axes", [(TokenAxis,) * 3, (LayerAxis,) * 3, (TokenAxis, LayerAxis, LayerAxis)],
                         ids=["token", "layer", "mixed"])
def test_a_batched_step_matches_per_request_steps(tiny_model, axes):
    with torch.inference_mode():
        alone = jobs_of(tiny_model, seed=7)
        for axis_type, job in zip(axes, alone):
            restore_split(axis_type(job), job.prefix_length * (len(job.layers) if axis_type is LayerAxis else 1))
        alone_logits = [job.model.logits(job.compute_rows(slice(job.prefix_length, len(job.token_ids)))[-1:])[0]
                        for job in alone]

        together = jobs_of(tiny_model, seed=7)
        compute_together([axis_type(job) for axis_type, job in zip(axes, together)], size=3)
        together_logits = remainders(together)

    for a, b, logits_a, logits_b in zip(alone, together, alone_logits, together_logits):
        torch.testing.assert_close(logits_b, logits_a, **TOLERANCE)
        n = len(a.token_ids)
        for layer in range(tiny_model.num_layers):
            for got, want in zip(b.cache.layer(layer), a.cache.layer(layer)):
                torch.testing.assert_close(got[:n], want[:n], **TOLERANCE)
        full = tiny_model.prefill(a.token_ids)  # and both are a full prefill's
        torch.testing.assert_close(logits_b, full.logits, **TOLERANCE)


def test_at_the_model_s_last_layer_each_run_finishes_its_last_row_alone(tiny_model, finished_rows):
    """Past the last layer only the LM head takes a hidden state, and only a prompt's last row: each run of a
    batched step writes every row's KV there but finishes one row, and the logits are still a full prefill's."""
    with torch.inference_mode():
        jobs = jobs_of(tiny_model, seed=3)
        for job in jobs:
            restore_split(TokenAxis(job), job.prefix_length)
        finished_rows.clear()
        logits = remainders(jobs)
    last, rows = tiny_model.num_layers - 1, sum(len(job.token_ids) - job.prefix_length for job in jobs)
    assert finished_rows == [(layer, rows) for layer in range(last)] + [(last, len(jobs))]
    for job, got in zip(jobs, logits):
        torch.testing.assert_close(got, tiny_model.prefill(job.token_ids).logits, **TOLERANCE)
