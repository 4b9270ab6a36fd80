"""An upstream's embeddings answer read into the engine's result: one finite vector per input, in index order."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from inferflux.backends.openai.engine import embedding_result
from inferflux.backends.openai.errors import UpstreamFailed
from inferflux.backends.openai.request import RemoteEmbeddingRequest

REQUEST = RemoteEmbeddingRequest("emb-1", {"model": "m", "input": ["a", "b"]}, num_inputs=2, prompt_tokens=7)


def item(index: Any, vector: Any) -> dict[str, Any]:
    return {"object": "embedding", "index": index, "embedding": vector}


def test_rows_follow_the_index_and_the_upstreams_count_is_kept() -> None:
    answer = {"data": [item(1, [0.5, 2]), item(0, [1, -1])], "usage": {"prompt_tokens": 4, "total_tokens": 4}}
    result = embedding_result(answer, REQUEST)
    assert result.vectors.dtype == np.float32
    np.testing.assert_array_equal(result.vectors, [[1, -1], [0.5, 2]])
    assert result.prompt_tokens == 4


@pytest.mark.parametrize("usage", [None, {}, {"prompt_tokens": -1}, {"prompt_tokens": True}, {"prompt_tokens": "4"}])
def test_without_a_usable_count_the_estimate_is_charged(usage: Any) -> None:
    answer = {"data": [item(0, [1.0]), item(1, [2.0])], **({"usage": usage} if usage is not None else {})}
    assert embedding_result(answer, REQUEST).prompt_tokens == 7


@pytest.mark.parametrize(
    "data",
    [
        None,
        [item(0, [1.0])],  # one vector for two inputs
        [item(0, [1.0]), item(0, [2.0])],  # an index twice
        [item(0, [1.0]), item(2, [2.0])],  # an index out of range
        [item(0, [1.0]), item(True, [2.0])],
        [item(0, [1.0]), item(1, [2.0, 3.0])],  # of different lengths
        [item(0, [1.0]), item(1, ["x"])],
        [item(0, [1.0]), item(1, [[1.0]])],
        [item(0, []), item(1, [])],
        [item(0, [1.0]), item(1, "AACAPw==")],  # base64, which the gateway never asks an upstream for
        [item(0, [1.0]), item(1, [float("nan")])],
        [item(0, [1.0]), "no"],
    ],
)
def test_a_malformed_answer_is_the_upstreams_failure(data: Any) -> None:
    with pytest.raises(UpstreamFailed):
        embedding_result({"data": data}, REQUEST)
