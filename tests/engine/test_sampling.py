import math

import pytest
import torch

from kvreuse.engine.sampling import InvalidSampling, Sampler, SamplingParams


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
                     ("seed", -(2**63) - 1), ("seed", 2**64), ("top_k", -2), ("min_p", 1.5),
                     ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                     ("repetition_penalty", float("inf")), ("min_tokens", -1), ("min_tokens", 200),
                     ("stop_token_ids", [-1]), ("logprobs", -1), ("logprobs", 21), ("logit_bias", {-1: 1.0}),
                     ("logit_bias", {3: 100.5}), ("logit_bias", {3: float("nan")})]
)
def test_bad_parameters_name_the_field(field, value):
    with pytest.raises(InvalidSampling, match=field) as raised:
        SamplingParams(**{field: value})
    assert raised.value.param == field


def test_a_negative_seed_draws_as_torch_takes_it():
    """torch.Generator takes seeds in [-2**63, 2**64), a negative one as 2**64 + seed: the server's seed range."""
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))

    def draws(seed: int) -> list[int]:
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [sampler(logits) for _ in range(20)]

    assert draws(-1) == draws(-1) == draws(2**64 - 1) != draws(1)


def test_top_k_keeps_only_the_k_most_likely():
    logits = torch.log(torch.tensor([0.1, 0.4, 0.3, 0.2]))
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=0))
    assert {sampler(logits) for _ in range(300)} == {1, 2}
    everything = Sampler(SamplingParams(temperature=1.0, top_k=-1, seed=0))
    assert {everything(logits) for _ in range(300)} == {0, 1, 2, 3}


def test_min_p_drops_tokens_far_less_likely_than_the_top_one():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=0.25, seed=0))  # keeps p >= 0.125
    assert {sampler(logits) for _ in range(300)} == {0, 1, 2}


def test_penalties_follow_vllm():
    """Repetition: positive logits of tokens in the prompt or output divided, the rest multiplied; frequency and
    presence: subtracted per occurrence in the output, and once."""
    logits = torch.tensor([2.0, -1.0, 1.5, 0.5])
    sampler = Sampler(SamplingParams(repetition_penalty=2.0), prompt=torch.tensor([1, 2]))
    assert sampler(logits) == 0  # 2.0 stays; 1.5 -> 0.75, -1 -> -2
    assert torch.equal(sampler._adjusted(logits), torch.tensor([1.0, -2.0, 0.75, 0.5]))  # 0 is in the output now
    counted = Sampler(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25))
    assert [counted(logits) for _ in range(3)] == [0, 2, 0]  # 2.0 -> 1.25 after one 0; 1.5 -> 0.75 after one 2
    assert torch.equal(counted._adjusted(logits), torch.tensor([0.75, -1.0, 0.75, 0.5]))  # two 0s: 2 - 1 - 0.25


def test_logit_bias_is_added_to_the_tokens_logits_before_the_penalties():
    logits = torch.tensor([2.0, -1.0, 1.5, 0.5])
    assert Sampler(SamplingParams(temperature=0, logit_bias={0: -100}))(logits) == 2  # -100 all but bans a token
    assert Sampler(SamplingParams(temperature=0, logit_bias={1: 3.5}))(logits) == 1  # -1 + 3.5 passes 2.0
    forced = Sampler(SamplingParams(temperature=1.0, seed=0, logit_bias={3: 100}))
    assert {forced(logits) for _ in range(50)} == {3}
    # vLLM's order: the bias first, then the repetition penalty divides the (now positive) biased logit
    penalized = Sampler(SamplingParams(logit_bias={1: 4.0}, repetition_penalty=2.0), prompt=torch.tensor([1]))
    assert torch.equal(penalized._adjusted(logits), torch.tensor([2.0, 1.5, 1.5, 0.5]))  # (-1 + 4) / 2, not -2 + 4


def test_logit_bias_outside_the_vocabulary_is_named():
    with pytest.raises(InvalidSampling, match="logit_bias: token id 4 is outside the vocabulary") as raised:
        Sampler(SamplingParams(logit_bias={4: 1.0}))(torch.zeros(4))
    assert raised.value.param == "logit_bias"


def test_min_tokens_holds_back_eos_and_stop_tokens_until_then():
    logits = torch.tensor([0.0, 5.0, 4.0, 1.0])  # 1 is EOS, 2 a stop token
    sampler = Sampler(SamplingParams(min_tokens=2, stop_token_ids=[2]), eos_ids={1})
    assert [sampler(logits) for _ in range(3)] == [3, 3, 1]
    ignoring = Sampler(SamplingParams(min_tokens=1, ignore_eos=True), eos_ids={1})
    assert ignoring(logits) == 1  # EOS ends nothing then: not held back


def test_a_temperature_too_small_to_scale_the_logits_by_is_greedy():
    logits = torch.tensor([1.0, 3.0, 2.0])
    assert Sampler(SamplingParams(temperature=1e-45, seed=0))(logits) == 1  # logits / 1e-45 overflow to inf


def test_one_stop_string_is_one_stop_not_one_per_character():
    assert SamplingParams(stop="member").stop == ["member"]


@pytest.mark.parametrize("fields, message", [
    ({"max_tokens": 16.0}, "max_tokens: expected a whole number"), ({"max_tokens": True}, "max_tokens"),
    ({"seed": "7"}, "seed: expected a whole number"), ({"stop": ["ok", 3]}, "stop: expected a text or a list"),
    ({"temperature": "0.5"}, "temperature: expected a number"), ({"top_p": None}, "top_p: expected a number"),
    ({"logit_bias": {"3": 1.0}}, "logit_bias: expected token ids"), ({"logit_bias": [3]}, "logit_bias: expected"),
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


def test_logprobs_are_the_models_own_distribution_whatever_the_sampling():
    """vLLM's raw_logprobs: before biases, penalties, temperature and filtering, so that a client reads what the model
    predicted; the alternatives most likely first."""
    logits = torch.tensor([2.0, 0.5, 1.0, -1.0, 3.0])
    raw = logits.log_softmax(-1)
    sampler = Sampler(SamplingParams(temperature=1.7, top_k=2, repetition_penalty=1.5, seed=3, logprobs=3,
                                     logit_bias={1: 5.0}), prompt=torch.tensor([4]))
    token = sampler(logits)
    chosen = sampler.last_logprob
    assert chosen.token == token and chosen.logprob == pytest.approx(float(raw[token]))
    assert [t for t, _ in chosen.top] == [4, 0, 2]
    assert [lp for _, lp in chosen.top] == pytest.approx(raw[[4, 0, 2]].tolist())
    assert Sampler(SamplingParams(logprobs=0)).__call__(logits) == 4
    none = Sampler(SamplingParams())
    none(logits)
    assert none.last_logprob is None


def test_a_token_of_probability_zero_reports_a_finite_logprob():
    sampler = Sampler(SamplingParams(logprobs=3))
    sampler(torch.tensor([0.0, -math.inf, 1.0]))
    assert sampler.last_logprob.top[-1][1] == -9999.0  # -inf has no JSON form
