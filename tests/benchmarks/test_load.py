"""benchmarks/load.py: its accounting (sent vs /metrics, the cancel race), RSS trend, and a short soak against
the tiny test server that must account for every request and see no server error."""

from __future__ import annotations

import os
import random
from collections import Counter

import pytest

from benchmarks.load import (Report, Sent, agreement, long_rag_prompt, mean_waits, parse_args, parse_mix, percentile,
                             print_report, rss_summary, run, summarise)
from kvreuse.eval.datasets import ChunkedPrompt


def test_sent_and_counted_agree_row_by_row_and_a_miscount_is_reported():
    sent = [Sent("rag", "chat", 200), Sent("rag", "chat", 200), Sent("malformed:x", "chat", 400, (400,))]
    rows, agree = agreement(sent, Counter({("chat", "200"): 2, ("chat", "400"): 1}))
    assert agree and {(r["status"], r["sent"], r["counted"]) for r in rows} == {("200", 2, 2), ("400", 1, 1)}
    rows, agree = agreement(sent, Counter({("chat", "200"): 2, ("chat", "400"): 2, ("caches", "200"): 1}))
    assert not agree
    assert {(r["endpoint"], r["status"]) for r in rows if r["sent"] != r["counted"]} == {("chat", "400"),
                                                                                        ("caches", "200")}


def test_a_cancel_that_lost_the_race_to_the_end_counts_as_finished():
    sent = [Sent("rag", "chat", 200), Sent("cancel_stream", "chat"), Sent("abandon", "chat")]
    # one cancel arrived in time (499), the other request finished first (a second 200)
    rows, agree = agreement(sent, Counter({("chat", "200"): 2, ("chat", "499"): 1}))
    assert agree, rows
    _, agree = agreement(sent, Counter({("chat", "200"): 1, ("chat", "499"): 1}))  # one request never counted
    assert not agree


def test_rss_slope_after_warm_up():
    growing = [(t, 1000 + t) for t in range(0, 600, 5)]  # 1 MB per second
    summary = rss_summary(growing, warmup=60)
    assert summary["slope_mb_per_min"] == pytest.approx(60) and summary["after_warmup_mb"] == 1060
    flat = [(t, 1000.0 if t < 60 else 1500.0) for t in range(0, 600, 5)]  # grows during warm-up only
    assert rss_summary(flat, warmup=60)["slope_mb_per_min"] == pytest.approx(0)


def test_a_first_token_s_wait_is_split_into_its_parts_means():
    waits = Counter({("ttft", "sum"): 10.0, ("ttft", "count"): 4, ("queue", "sum"): 6.0, ("queue", "count"): 4,
                     ("prefill", "sum"): 2.0, ("prefill", "count"): 4, ("paused", "count"): 4})
    assert mean_waits(waits) == {"ttft": 2.5, "queue": 1.5, "prefill": 0.5, "paused": 0.0, "other": 0.5}
    del waits["queue", "count"]  # a server without the histogram
    assert mean_waits(waits)["queue"] is None and mean_waits(waits)["other"] is None


@pytest.mark.parametrize("pending", [3.0, None])  # None: a server without the gauge
def test_the_report_prints_the_wait_split_the_pending_writes_and_the_tokens_reused(capsys, pending):
    report = Report(10.0, 2, {"rag": 1}, {}, 0, 1.0, 1.0, 1.0, {}, [], [], True, "", 0.5,
                    server_waits_s={"ttft": 2.5, "queue": 1.5, "prefill": 0.5, "paused": 0.0, "other": 0.5},
                    write_back_pending=pending, reused_tokens=(300.0, 1200.0) if pending else None)
    print_report(report)
    out = capsys.readouterr().out
    assert (f"TTFT 2.50 s = queue 1.50 + prefill 0.50 + paused 0.00 + other 0.50; store writes pending at the end: "
            f"{'3' if pending else 'n/a'}") in out
    assert ("prompt tokens reused from the store: 300 of 1200 (0.25)" in out) == bool(pending)


def test_percentiles_interpolate_as_the_benches_do():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5 and percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == 4.6
    assert percentile([], 90) != percentile([], 90)  # nan: no sample


def test_a_mix_naming_an_unknown_kind_is_refused():
    assert parse_mix("rag=1,identical=0.5") == {"rag": 1.0, "identical": 0.5}
    with pytest.raises(SystemExit, match="unknown kind 'flood'"):
        parse_mix("rag=1,flood=2")


def test_long_rag_prompts_join_several_rows_passages_in_lengths_that_vary():
    rows = [ChunkedPrompt(f"r{i}", [f"r{i}p{j}" for j in range(10)], f"q{i}", [], "qa") for i in range(8)]
    rng = random.Random(0)
    prompts = [long_rag_prompt(rows, rng) for _ in range(20)]
    assert parse_mix("rag=1,long_rag=0.2") == {"rag": 1.0, "long_rag": 0.2}
    for prompt in prompts:
        sources = list(dict.fromkeys(chunk.split("p")[0] for chunk in prompt.chunks))
        assert 2 <= len(sources) <= 4 and prompt.question == f"q{sources[0][1:]}"
    assert len({len(p.chunks) for p in prompts}) > 5


def test_long_rag_chats_have_their_own_ttft_line(capsys):
    sent = [Sent("rag", "chat", 200, ttft=1.0), Sent("long_rag", "chat", 200, ttft=3.0),
            Sent("long_rag", "chat", 200, ttft=5.0), Sent("long_rag", "chat", 503, ttft=9.0)]
    args = parse_args(["--url", "http://127.0.0.1:1", "--duration", "1"])
    report = summarise(sent, Counter(), True, [], 1.0, args)
    assert report.ttft_p50_s == 1.0 and report.long_rag_ttft_s == {"p50": 4.0, "p90": 4.8, "p99": 4.98}
    print_report(report)
    assert "long RAG TTFT p50 4.00 s, p90 4.80 s, p99 4.98 s" in capsys.readouterr().out
    assert summarise(sent[:1], Counter(), True, [], 1.0, args).long_rag_ttft_s is None


def test_a_short_soak_accounts_for_every_request(make_server):
    server = make_server(api_key="soak-key", max_concurrency=2)
    args = parse_args(["--url", server.url, "--api-key", "soak-key", "--duration", "4", "--clients", "3",
                       "--max-tokens", "4", "--pool", "2", "--abandon-after", "0.2", "--rss-interval", "1",
                       "--mix", "rag=1,identical=1,cancel_stream=1,abandon=1,malformed=2,completion=1"])
    report = run(server.url, os.getpid(), args)
    assert report.failures_by_kind == {} and report.server_errors == 0, report.failure_samples
    assert set(report.sent_by_kind) == {"rag", "identical", "cancel_stream", "abandon", "malformed", "completion"}
    assert report.metrics_agree, report.metrics_rows
    assert sum(r["sent"] for r in report.metrics_rows) == sum(report.sent_by_kind.values())
    assert report.rss_series and report.ttft_p50_s > 0
    waits = report.server_waits_s
    assert waits["ttft"] > 0 and waits["prefill"] > 0 and waits["other"] > -1e-6, waits
    assert report.write_back_pending is not None
    cached, prompt = report.reused_tokens  # the finished chats' prompt tokens, read from the server's counters
    assert 0 < cached < prompt  # two rows of documents sent again and again: some come from the store
