"""Every backend's ``embed`` against transformers, and the paged KV cache it must leave alone.

Embeddings are the final hidden states (after the final norm) pooled over each input:
their mean, or the last token's. The oracle is transformers' own base model on the tiny
random checkpoints of every supported architecture and variant
(tests/support/tiny_checkpoints.py), and on the default SmolLM2 model, in float32.
``embed`` runs between the engine's steps while other sequences' KV lives in the cache,
so it must neither read nor write it: the logits of a step after it equal those
without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import oracles
from tiny_checkpoints import BLOCK, VARIANTS, mixed_steps, run_steps, write_variant

from inferflux.backends import registry
from inferflux.backends.base import Batch, ModelSpec

torch = pytest.importorskip("torch")
transformers = oracles.require("transformers")

# Float32 against float32, summed in other orders (the mean: over up to 70 rows).
ATOL = 1e-4


def token_lists(vocab: int) -> list[list[int]]:
    """One token, a few, a block's worth and more, and 70 (past llama3-scaled's original context of 32)."""
    rng = np.random.default_rng(7)
    return [rng.integers(0, vocab, n).tolist() for n in (1, 5, 9, 16, 70)]


def transformers_pooled(model: Any, lists: list[list[int]]) -> dict[str, np.ndarray]:
    """Each list run alone through transformers' base model: the mean and the last of its final hidden states."""
    mean, last = [], []
    for ids in lists:
        with torch.no_grad():
            hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
        mean.append(hidden.mean(0).numpy())
        last.append(hidden[-1].numpy())
    return {"mean": np.stack(mean), "last": np.stack(last)}


def host(tensor: Any) -> np.ndarray:
    """A copy on the host of a cache tensor (torch, on any device, or mlx)."""
    return tensor.cpu().numpy().copy() if hasattr(tensor, "cpu") else np.array(tensor)


def backend_with_embed(backend_name: str) -> Any:
    backend = registry.get_backend(backend_name)()
    if not callable(getattr(backend, "embed", None)):
        pytest.skip(f"the {backend_name} backend has no embed (optional): it answers that it serves no embeddings")
    return backend


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_float32_embeddings_equal_transformers(backend_name: str, variant: str, tmp_path: Any) -> None:
    backend = backend_with_embed(backend_name)
    path = write_variant(tmp_path, variant)
    info = backend.load(ModelSpec(variant, str(path), dtype="float32"))
    assert info.hidden_size == 64
    lists = token_lists(info.vocab_size)
    want = transformers_pooled(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
                               lists)  # fmt: skip
    for pooling in ("mean", "last"):
        got = np.asarray(backend.embed(lists, pooling))
        assert got.shape == (len(lists), 64) and got.dtype == np.float32, pooling
        np.testing.assert_allclose(got, want[pooling], atol=ATOL, rtol=0, err_msg=f"{variant}, {pooling}")
        # Batched or alone, the same vectors: nothing leaks between the sequences of a batch.
        alone = np.concatenate([np.asarray(backend.embed([ids], pooling)) for ids in lists])
        np.testing.assert_allclose(got, alone, atol=ATOL, rtol=0, err_msg=f"{variant}, {pooling}, alone")


def test_embed_leaves_the_kv_cache_and_the_next_step_alone(backend_name: str, tmp_path: Any) -> None:
    backend = backend_with_embed(backend_name)
    path = write_variant(tmp_path, "qwen3")
    info = backend.load(ModelSpec("tiny", str(path), dtype="float32"))
    steps = mixed_steps()
    plain = run_steps(backend, steps)  # fresh cache, the steps alone
    backend.allocate_kv(32, BLOCK)
    interleaved = []
    for step in steps:
        before = [[host(t) for t in layer] for layer in backend.kv_caches]
        backend.embed(token_lists(info.vocab_size), "mean")  # between two steps, as the engine runs it
        after = [[host(t) for t in layer] for layer in backend.kv_caches]
        for b, a in zip(before, after, strict=True):
            np.testing.assert_array_equal(b[0], a[0])
            np.testing.assert_array_equal(b[1], a[1])
        interleaved.append(np.asarray(backend.forward(Batch(step, BLOCK)), dtype=np.float32))
    for i, (got, want) in enumerate(zip(interleaved, plain, strict=True)):
        np.testing.assert_array_equal(got, want, err_msg=f"step {i}")


def test_the_default_model_embeds_as_transformers_does(loaded: Any, tokenizer: Any, hf_causal_lm: Any) -> None:
    backend, _ = loaded
    if not callable(getattr(backend, "embed", None)):
        pytest.skip("this backend has no embed (optional)")
    texts = ["Hello", "The quick brown fox jumps over the lazy dog.", "Embeddings are pooled hidden states " * 8]
    lists = [tokenizer.encode(text) for text in texts]
    want = transformers_pooled(hf_causal_lm, lists)
    for pooling in ("mean", "last"):
        np.testing.assert_allclose(np.asarray(backend.embed(lists, pooling)), want[pooling], atol=ATOL, rtol=0,
                                   err_msg=pooling)  # fmt: skip
