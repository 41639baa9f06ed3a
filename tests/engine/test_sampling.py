import pytest
import torch

from kvreuse.engine.sampling import Sampler, SamplingParams


def test_greedy_takes_the_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert Sampler(SamplingParams(temperature=0))(logits) == 1


def test_seed_makes_sampling_reproducible():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    first, second = Sampler(SamplingParams(temperature=1.0, seed=7)), Sampler(SamplingParams(temperature=1.0, seed=7))
    assert [first(logits) for _ in range(20)] == [second(logits) for _ in range(20)]
    other_seeds = {Sampler(SamplingParams(temperature=1.0, seed=seed))(logits) for seed in range(20)}
    assert len(other_seeds) > 1, "different seeds should draw different tokens"


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.75, seed=0))
    assert {sampler(logits) for _ in range(300)} == {0, 1}


@pytest.mark.parametrize("top_p", [1e-9, 5e-324])  # 5e-324 rounds to 0 in float32 (found by the server fuzz test)
def test_a_tiny_top_p_keeps_the_top_token(top_p):
    logits = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    assert Sampler(SamplingParams(temperature=1.0, top_p=top_p, seed=0))(logits) == 1


@pytest.mark.parametrize(
    "field, value", [("max_tokens", 0), ("temperature", -0.5), ("temperature", float("nan")),
                     ("temperature", float("inf")), ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")),
                     ("seed", -1), ("seed", 2**64)]
)
def test_bad_parameters_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_a_temperature_too_small_to_scale_the_logits_by_is_greedy():
    logits = torch.tensor([1.0, 3.0, 2.0])
    assert Sampler(SamplingParams(temperature=1e-45, seed=0))(logits) == 1  # logits / 1e-45 overflow to inf


def test_one_stop_string_is_one_stop_not_one_per_character():
    assert SamplingParams(stop="member").stop == ["member"]


@pytest.mark.parametrize("fields, message", [
    ({"max_tokens": 16.0}, "max_tokens: expected a whole number"), ({"max_tokens": True}, "max_tokens"),
    ({"seed": "7"}, "seed: expected a whole number"), ({"stop": ["ok", 3]}, "stop: expected a text or a list"),
    ({"temperature": "0.5"}, "temperature: expected a number"), ({"top_p": None}, "top_p: expected a number"),
])
def test_parameters_of_the_wrong_type_name_the_field(fields, message):
    with pytest.raises(TypeError, match=message):
        SamplingParams(**fields)


def test_a_masked_token_keeps_temperature_sampling_and_nan_is_an_error():
    logits = torch.tensor([1.0, 1.0, float("-inf"), 1.0])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    drawn = {sampler(logits) for _ in range(200)}
    assert drawn == {0, 1, 3}  # sampled, never the masked token, not greedy's argmax alone
    with pytest.raises(ValueError, match="NaN"):
        sampler(torch.tensor([1.0, float("nan")]))
