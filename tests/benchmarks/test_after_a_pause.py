"""benchmarks/after_a_pause.py on the tiny engine: each way of spending the time before a request spends it as
named, and every method is timed after every one of them, each round."""

from __future__ import annotations

import time

import torch

from benchmarks.after_a_pause import conditions, first_touch_ns, time_after


def test_each_condition_spends_the_pause_it_names_and_the_sweep_passes_over_its_memory():
    other = torch.zeros(2**20)
    spend = conditions(0.05, other)
    assert list(spend) == ["back to back", "after a sweep of other memory", "after 0.05 s asleep",
                           "after 0.05 s spinning one thread", "after 0.05 s of other work on every thread"]
    for name, call in spend.items():
        start = time.perf_counter()
        call()
        took = time.perf_counter() - start
        assert (took >= 0.05) == name.endswith(("asleep", "thread")), (name, took)
    assert other.eq(1).all()  # swept once, every element


def test_every_method_is_timed_after_every_condition_each_round(tiny_engine, rag_request):
    request = rag_request()
    tiny_engine.compile(request, ["naive", "legolink:4"])
    order = []
    spend = {name: (lambda name=name: order.append(name)) for name in ("back to back", "asleep")}
    seconds = time_after(tiny_engine, request, ["naive", "legolink:4"], spend, rounds=3)
    assert {m: {c: len(s) for c, s in by.items()} for m, by in seconds.items()} == {
        "naive": {"back to back": 3, "asleep": 3}, "legolink:4": {"back to back": 3, "asleep": 3}}
    assert all(t > 0 for by in seconds.values() for s in by.values() for t in s)
    assert order.count("back to back") == order.count("asleep") == 6  # before each method's prefill, each round


def test_the_page_probe_times_each_pause():
    touches = first_touch_ns([0.0, 0.02], megabytes=4, repeats=2)
    assert list(touches) == [0.0, 0.02] and all(ns > 0 for ns in touches.values())
