"""The CUDA backend's runner, on whatever this machine has.

The same ``CUDABackend`` class runs here with its device and kernel set as
parameters: (a) on the CPU with ``kernels.reference``, (b) with ``kernels.triton``
(under Triton's interpreter on the CPU when there is no GPU, compiled on the GPU
when there is one). A tiny random llama-shaped model is written as a safetensors
directory and loaded through the real loader; every logit is compared with the CPU
backend's model on the same weights running each sequence's whole context as one
fresh prefill, which reads nothing back from the paged cache. CUDA graph capture
needs a CUDA device; the padding around it is tested here without one.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

# Without a GPU, tests/conftest.py has set TRITON_INTERPRET=1 before this import.
from inferflux.backends.base import Batch, BackendError, ModelSpec, SequenceSlice
from inferflux.backends.cpu import CPUBackend
from inferflux.backends.cuda import CUDABackend
from inferflux.backends.cuda.graphs import graph_batch_size
from inferflux.backends.cuda.swap import slot_runs
from inferflux.kernels import reference
from inferflux.kernels.errors import KernelError

HAS_CUDA = torch.cuda.is_available()
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"
BLOCK = 4
NUM_BLOCKS = 24
VOCAB = 300
CONFIG = {
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
ATOL = 1e-4  # float32 throughout; the paths differ only in summation order

rng = np.random.default_rng(7)
# Three sequences' tokens and scattered, interleaved physical blocks.
TOKENS = {s: rng.integers(1, VOCAB, size=14).tolist() for s in "abc"}
TABLES = {"a": [17, 3, 9, 20], "b": [5, 0, 22, 11], "c": [8, 14, 2, 19]}


class ReferenceCPUBackend(CPUBackend):
    """The oracle: the CPU backend on the reference kernels (no C++ build needed)."""

    @staticmethod
    def _use_kernels(model):
        return "test oracle: reference kernels"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from safetensors.numpy import save_file

    path = tmp_path_factory.mktemp("tiny-llama")
    c = CONFIG
    h, hd, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q_out, kv_out = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    gen = np.random.default_rng(0)

    def w(*shape: int, scale: float = 0.15) -> np.ndarray:
        return (gen.standard_normal(shape) * scale).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": w(VOCAB, h, scale=1.0),
        "model.norm.weight": 1 + w(h, scale=0.1),
        "lm_head.weight": w(VOCAB, h),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(q_out, h),
            p + "self_attn.k_proj.weight": w(kv_out, h),
            p + "self_attn.v_proj.weight": w(kv_out, h),
            p + "self_attn.o_proj.weight": w(h, q_out),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": 1 + w(h, scale=0.1),
            p + "post_attention_layernorm.weight": 1 + w(h, scale=0.1),
        }
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(c))
    return str(path)


@pytest.fixture(scope="module")
def spec(model_dir) -> ModelSpec:
    return ModelSpec(name="tiny", path=model_dir, dtype="float32")


@pytest.fixture(scope="module")
def oracle(spec):
    """``oracle(seq, length, rows)``: logits of the last ``rows`` of the first ``length`` tokens."""
    be = ReferenceCPUBackend()
    be.load(spec)
    be.allocate_kv(NUM_BLOCKS, BLOCK)
    cache: dict[tuple[str, int], np.ndarray] = {}

    def logits(seq: str, length: int, rows: int = 1) -> np.ndarray:
        if (seq, length) not in cache:
            ids = TOKENS[seq][:length]
            batch = Batch([SequenceSlice(0, ids, 0, list(range(-(-length // BLOCK))), len(ids))], BLOCK)
            cache[seq, length] = np.asarray(be.forward(batch))
        return cache[seq, length][length - rows :]

    return logits


def make_runner(spec, kind: str, **kwargs) -> CUDABackend:
    if kind == "reference":
        runner = CUDABackend(device="cpu", kernels=reference, cuda_graphs=False, **kwargs)
    else:
        from inferflux.kernels import triton as triton_kernels

        runner = CUDABackend(device=TRITON_DEVICE, kernels=triton_kernels, cuda_graphs=False, **kwargs)
    info = runner.load(spec)
    assert info.dtype == "float32" and info.vocab_size == VOCAB
    runner.allocate_kv(NUM_BLOCKS, BLOCK)
    return runner


def sl(seq: str, start: int, n: int, logits: int = 1, table: list[int] | None = None) -> SequenceSlice:
    return SequenceSlice("abc".index(seq), TOKENS[seq][start : start + n], start, table or TABLES[seq], logits)


def run(runner, *slices: SequenceSlice) -> np.ndarray:
    out = runner.forward(Batch(list(slices), BLOCK))
    assert isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.dtype == torch.float32
    return out.numpy()


def check(got: np.ndarray, *expected: np.ndarray) -> None:
    want = np.concatenate(expected)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def prefill_b_and_c(runner, oracle) -> None:
    """Step 1: b's whole 9-token prompt, c's first 6-token chunk (no logits)."""
    check(run(runner, sl("b", 0, 9), sl("c", 0, 6, logits=0)), oracle("b", 9))


def mixed_step(runner, oracle) -> None:
    """Step 2: a fresh prefill, a decode and a continuation chunk with start_pos > 0, in one batch."""
    got = run(runner, sl("a", 0, 7, logits=2), sl("b", 9, 1), sl("c", 6, 5, logits=5))
    check(got, oracle("a", 7, 2), oracle("b", 10), oracle("c", 11, 5))


def decode_step(runner, oracle, **tables) -> np.ndarray:
    """Step 3: decode only, one token each for a (pos 7), b (pos 10), c (pos 11)."""
    got = run(runner, sl("a", 7, 1, table=tables.get("a")), sl("b", 10, 1, table=tables.get("b")),
              sl("c", 11, 1, table=tables.get("c")))
    check(got, oracle("a", 8), oracle("b", 11), oracle("c", 12))
    return got


@pytest.mark.parametrize("kind", ["reference", "triton"])
def test_mixed_batches_match_the_cpu_backend(spec, oracle, kind):
    runner = make_runner(spec, kind)
    assert all(layer.attn.kernels is runner.kernels for layer in runner.model.layers)
    assert runner.kv_caches[0][0].device.type == (TRITON_DEVICE if kind == "triton" else "cpu")
    prefill_b_and_c(runner, oracle)
    mixed_step(runner, oracle)
    decode_step(runner, oracle)


@pytest.mark.parametrize("directory", [False, True], ids=["host", "disk"])
def test_swap_round_trip_into_other_blocks(spec, oracle, directory, tmp_path):
    runner = make_runner(spec, "reference")
    prefill_b_and_c(runner, oracle)
    mixed_step(runner, oracle)  # b now holds 10 positions in blocks 5, 0, 22
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    runner.allocate_swap(6, BLOCK, str(tmp_path) if directory else None)
    # Slots 4, 5 are one run and 1 another: both copy paths.
    runner.swap_out([(5, 4), (0, 5), (22, 1)])
    for k, v in runner.kv_caches:  # what a sequence that takes the blocks over would do to them
        for c in (k, v):
            c[:, [5, 0, 22]] = torch.randn_like(c[:, [5, 0, 22]])
    runner.swap_in([(4, 12), (5, 13), (1, 6)])
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        assert torch.equal(k[:, [12, 13, 6]], k0[:, [5, 0, 22]])
        assert torch.equal(v[:, [12, 13, 6]], v0[:, [5, 0, 22]])
    decode_step(runner, oracle, b=[12, 13, 6, 11])
    with pytest.raises(BackendError, match="out of range|swap slot"):
        runner.swap_out([(3, 6)])


def test_copy_blocks_is_copy_on_write(spec, oracle):
    runner = make_runner(spec, "reference")
    prefill_b_and_c(runner, oracle)
    mixed_step(runner, oracle)
    # c's 11 positions end in block 2 (positions 8..10): give it a private copy in block 23.
    runner.copy_blocks([(2, 23)])
    for k, v in runner.kv_caches:
        assert torch.equal(k[:, 23], k[:, 2]) and torch.equal(v[:, 23], v[:, 2])
    for k, v in runner.kv_caches:  # the original is now someone else's
        k[:, 2], v[:, 2] = torch.randn_like(k[:, 2]), torch.randn_like(v[:, 2])
    decode_step(runner, oracle, c=[8, 14, 23, 19])


def test_graph_batch_sizes_and_swap_runs():
    assert [graph_batch_size(n) for n in (1, 2, 3, 4, 5, 8, 9, 17, 32)] == [1, 2, 4, 4, 8, 8, 16, 32, 32]
    assert graph_batch_size(33) is None and graph_batch_size(0) is None
    assert graph_batch_size(3, sizes=(8, 2)) == 8
    assert slot_runs([4, 5, 1, 2, 3, 9]) == [(0, 2, 4), (2, 3, 1), (5, 1, 9)]
    assert slot_runs([]) == []


def test_padded_decode_steps_write_only_the_scratch_block(spec, oracle):
    """The graphed decode path without the capture: inputs copied into static buffers,
    padded to the next size, run eagerly. Logits and every real block must equal the
    plain eager step; padding may write only the scratch block."""
    runner = make_runner(spec, "reference")
    assert runner.scratch_block == NUM_BLOCKS and runner.kv_caches[0][0].shape[1] == NUM_BLOCKS + 1
    prefill_b_and_c(runner, oracle)
    mixed_step(runner, oracle)
    snapshot = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    eager = decode_step(runner, oracle)
    eager_caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for (k, v), (k0, v0) in zip(runner.kv_caches, snapshot):
        k.copy_(k0), v.copy_(v0)

    graphs = runner.decode_graphs = runner.decode_graphs_for(sizes=(1, 2, 4))
    assert graphs.width == CONFIG["max_position_embeddings"] // BLOCK
    assert graphs.size_for(Batch([sl("a", 7, 1), sl("b", 10, 1), sl("c", 11, 1)], BLOCK)) == 4
    assert graphs.size_for(Batch([sl("a", 0, 7), sl("b", 10, 1)], BLOCK)) is None  # a prefill: eager
    assert graphs.size_for(Batch([sl(s, 3, 1) for s in "abcab"], BLOCK)) is None  # past the largest size
    padded = decode_step(runner, oracle)
    np.testing.assert_allclose(padded, eager, atol=1e-5, rtol=0)
    scratch = runner.scratch_block
    for (k, v), (ke, ve) in zip(runner.kv_caches, eager_caches):
        # Close, not equal: a 4-row projection may round differently from a 3-row one.
        torch.testing.assert_close(k[:, :scratch], ke[:, :scratch], atol=1e-5, rtol=0)
        torch.testing.assert_close(v[:, :scratch], ve[:, :scratch], atol=1e-5, rtol=0)
        assert v[:, scratch, 0].abs().sum() > 0  # the padded row's value landed in the scratch block
    # A mixed step with the graphs installed still runs eagerly, and correctly.
    got = run(runner, sl("a", 8, 2, logits=2), sl("b", 11, 1))
    check(got, oracle("a", 10, 2), oracle("b", 12))


def test_dtype_choice_and_device_checks():
    runner = CUDABackend(device="cpu", kernels=reference)
    assert runner._resolve_dtype("auto") in ("float32", "bfloat16")
    assert runner._resolve_dtype("float16") == "float16"
    assert runner.use_cuda_graphs is False  # nothing to capture on the cpu device
    with pytest.raises(BackendError, match="unsupported dtype"):
        runner._resolve_dtype("float64")
    with pytest.raises(BackendError, match="reference kernels run on the cpu device only"):
        CUDABackend(device="cuda", kernels=reference)
    with pytest.raises(BackendError, match="before load"):
        runner.forward(Batch([sl("a", 0, 2)], BLOCK))


def test_a_kernel_error_reaches_the_caller_as_a_backend_error(spec):
    runner = make_runner(spec, "triton")
    # Caches of another dtype than the activations: the Triton set refuses to store into them.
    runner.kv_caches = [(k.half(), v.half()) for k, v in runner.kv_caches]
    with pytest.raises(BackendError, match="kernels.triton: store_kv: tensors must share a dtype") as info:
        runner.forward(Batch([sl("a", 0, 2)], BLOCK))
    assert isinstance(info.value.__cause__, KernelError)
    assert info.value.details == {"kernels": "inferflux.kernels.triton"}


def test_probe_says_why_it_cannot_run_here():
    from inferflux.backends.registry import probe

    reason = CUDABackend.probe()
    assert probe("cuda").reason == reason
    if HAS_CUDA:
        assert reason is None
    else:
        assert "no CUDA or ROCm device" in reason


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_captured_decode_graphs_match_eager_steps(spec, oracle):
    runner = CUDABackend()  # the defaults: the GPU, Triton kernels, graphs on
    runner.load(ModelSpec(name="tiny", path=spec.path, dtype="float32"))
    runner.allocate_kv(NUM_BLOCKS, BLOCK)
    assert runner.graph_error is None and runner.decode_graphs is not None
    assert sorted(runner.decode_graphs.graphs) == [1, 2, 4, 8, 16, 32]
    prefill_b_and_c(runner, oracle)
    mixed_step(runner, oracle)

    def eager(*args, **kwargs):
        raise AssertionError("a decode step ran eagerly instead of replaying its graph")

    runner.model.forward = eager  # a replay never calls the module
    decode_step(runner, oracle)  # 3 sequences replay the size-4 graph
    # Swap on the side stream, straight into a graphed step that reads the swapped-in blocks.
    runner.allocate_swap(4, BLOCK, None)
    runner.swap_out([(5, 0), (0, 1), (22, 2)])
    runner.swap_in([(0, 12), (1, 13), (2, 6)])
    check(run(runner, sl("b", 11, 1, table=[12, 13, 6, 11])), oracle("b", 12))


@pytest.mark.parametrize("kind", ["reference", "triton"])
def test_embed_matches_the_cpu_backend_and_keeps_the_cache(spec, kind):
    """``embed`` (backends.base) on the device: the CPU backend's pooled vectors, the KV cache untouched."""
    runner = make_runner(spec, kind)
    run(runner, sl("b", 0, 9))  # something in the cache to keep
    cpu = ReferenceCPUBackend()
    cpu.load(spec)
    lists = [TOKENS["a"], TOKENS["b"][:1], TOKENS["c"][:9]]
    cache = [t.clone() for layer in runner.kv_caches for t in layer]
    for pooling in ("mean", "last"):
        got = np.asarray(runner.embed(lists, pooling))
        np.testing.assert_allclose(got, np.asarray(cpu.embed(lists, pooling)), atol=ATOL, rtol=0, err_msg=pooling)
    assert all(torch.equal(a, b) for a, b in zip(cache, (t for layer in runner.kv_caches for t in layer)))
