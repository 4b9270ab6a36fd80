import math

import pytest

from inferflux.backends.engine import SamplingParams, SamplingParamsError
from inferflux.backends.engine.errors import InvalidRequestError

VOCAB = 1000


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"seed": "42"}, "seed"),
        ({"seed": 2**70}, "seed"),
        ({"stop": [f"s{i}" for i in range(65)]}, "stop"),  # MAX_STOP_STRINGS; the gateway's bound is lower
        ({"stop": [""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
    ],
)
def test_invalid_params_name_the_field(kwargs, param):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs).validate(VOCAB)
    err = info.value
    assert err.param == param
    assert param in str(err)
    assert isinstance(err, ValueError) and isinstance(err, InvalidRequestError)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.0},
        {"temperature": 2.0, "top_p": 1.0, "top_k": -1, "min_p": 1.0},
        {"top_k": 0},
        {"top_k": 50, "top_p": 0.01},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0, "repetition_penalty": 5.0},
        {"seed": -1},
        {"seed": 2**64 - 1},
        {"stop": ["a", "b", "c", "d"], "stop_token_ids": [0, VOCAB - 1]},
        {"max_tokens": None, "min_tokens": 100},
        {"max_tokens": 1, "min_tokens": 1},
        {"logprobs": True, "top_logprobs": 20},
        {"logprobs": True, "top_logprobs": 0},
    ],
)
def test_valid_params(kwargs):
    SamplingParams(**kwargs).validate(VOCAB)


def test_stop_normalisation_and_greedy():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-7).greedy  # 1/T would overflow
    assert not SamplingParams(temperature=0.5).greedy
    assert SamplingParamsError("top_p", "bad").param == "top_p"
