"""The executor's observation hook: analyses see every layer's computed rows without a copy of the layer loop."""

import torch

from kvreuse.fusion.methods import parse_method


def test_observer_sees_each_layer_with_its_rows_and_kv(tiny_engine, rag_request):
    request = rag_request()
    tiny_engine.compile(request, ["cacheblend:0.2"])
    policy = parse_method("cacheblend:0.2")
    plan = policy.plan(request, tiny_engine.lookup(request, policy))
    seen = []

    def observe(layer, queries, rows, cache):
        keys, _ = cache.layer(layer)
        seen.append((layer, queries.shape[0], rows.clone(), keys[rows].clone()))

    result = tiny_engine.executor.run(plan, request.token_ids, observer=observe)
    model = tiny_engine.model
    assert [s[0] for s in seen] == list(range(model.num_layers))
    assert all(n == rows.numel() for _, n, rows, _ in seen)
    assert torch.equal(seen[0][2], plan.compute_rows)  # layer 0: everything the plan computes from the start
    assert seen[-1][2].numel() < seen[0][2].numel()  # CacheBlend narrowed the selection on its check layers
    for layer, _, rows, keys in seen:  # the observed KV is the layer's final KV
        torch.testing.assert_close(keys, result.cache.layer(layer)[0][rows])
