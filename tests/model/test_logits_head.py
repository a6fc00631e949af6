"""float32 logits: a near-tie that bfloat16 rounding would turn into a tie picks the float32 argmax.

lm_head rows A < B are built so that B's logit is 30.0625 and A's 30.0: bfloat16
has steps of 0.125 there and rounds both to 30.0, so argmax over bfloat16
logits picks A (the first maximum). Every head a bfloat16 model can be built
with keeps B ahead.
"""

from __future__ import annotations

import struct

import pytest
import torch

from asyncpp.kernels.argmax import argmax_rows
from asyncpp.kernels.isa import cpu_info
from asyncpp.kernels.linear_bf16 import bf16_native_kernel
from asyncpp.kernels.qlinear import qlinear_kernel
from asyncpp.model.logits_head import CudaHead, Float32Head, QLinearHead, ReusedRows, float32_logits_head
from asyncpp.model.native_linear import NativeLinear, NativeWeights
from asyncpp.model.packed_linear import KernelLinear
from asyncpp.weights import load_weights, read_arch, save_hf_directory
from asyncpp.weights.base import StoredTensor
from asyncpp.worker.stage import build_model_slice
from tests.conftest import TINY

A, B = 7, 11
BF16 = torch.bfloat16
HAS_BF16_KERNELS = cpu_info().supports("avx512_bf16") and bf16_native_kernel("avx512_bf16") is not None


def _near_tie_weight(vocab_size: int, hidden_size: int) -> torch.Tensor:
    weight = torch.zeros(vocab_size, hidden_size)
    weight[A, 0] = weight[B, 0] = 30.0
    weight[B, 1] = 0.0625  # every value exact in bfloat16
    return weight


def _inputs(hidden_size: int, *columns: int) -> torch.Tensor:
    x = torch.zeros(3, hidden_size, dtype=BF16)
    x[:, list(columns)] = 1.0
    return x


def _assert_float32_argmax(logits: torch.Tensor) -> None:
    assert logits.dtype == torch.float32
    assert bool((logits[:, B] - logits[:, A] == 0.0625).all())
    assert argmax_rows(logits).tolist() == [B] * logits.shape[0]
    rounded = logits.to(BF16)  # what a bfloat16 head would have handed the sampler
    assert bool((rounded[:, A] == rounded[:, B]).all()) and argmax_rows(rounded).tolist() == [A] * logits.shape[0]


@pytest.fixture(scope="module")
def near_tie_dir(tmp_path_factory):
    arch = read_arch("random", TINY)
    tensors = load_weights("random", TINY, start_layer=0, end_layer=arch.num_layers, need_embed=True, need_head=True)
    tensors["lm_head.weight"] = _near_tie_weight(arch.vocab_size, arch.hidden_size)
    directory = tmp_path_factory.mktemp("near-tie")
    save_hf_directory(directory, arch, tensors)
    return directory, arch


CASES = [
    pytest.param("auto", "native", NativeLinear, marks=pytest.mark.skipif(not HAS_BF16_KERNELS, reason="needs AVX512-BF16")),
    pytest.param("auto", "float", KernelLinear if HAS_BF16_KERNELS else QLinearHead, id="auto-float"),
    pytest.param("onednn", "float", QLinearHead, id="onednn-float"),
]


@pytest.mark.parametrize("linear_kernel,weight_format,head_type", CASES)
def test_a_bfloat16_model_s_head_keeps_the_float32_argmax(near_tie_dir, linear_kernel, weight_format, head_type):
    if qlinear_kernel() is None:
        pytest.skip("no C compiler")
    directory, arch = near_tie_dir
    model = build_model_slice(
        "hf", str(directory), arch, arch.num_layers - 1, arch.num_layers, BF16, "cpu", linear_kernel,
        weight_format=weight_format,
    )  # fmt: skip
    assert type(model.lm_head) is ReusedRows and type(model.lm_head.head) is head_type
    first = model.compute_logits(_inputs(arch.hidden_size, 0, 1))
    _assert_float32_argmax(first)
    # The rows are reused from step to step: as many or fewer rows are a view of them, more get new ones.
    assert model.compute_logits(_inputs(arch.hidden_size, 0, 1)).data_ptr() == first.data_ptr()
    assert model.compute_logits(_inputs(arch.hidden_size, 0, 1)[:2]).data_ptr() == first.data_ptr()
    more = torch.cat([_inputs(arch.hidden_size, 0, 1)] * 3)
    _assert_float32_argmax(model.compute_logits(more))


def test_a_float32_model_s_logits_stay_what_its_head_computes(near_tie_dir):
    directory, arch = near_tie_dir
    model = build_model_slice("hf", str(directory), arch, 3, 4, torch.float32, "cpu", "auto", weight_format="float")
    _assert_float32_argmax(model.compute_logits(_inputs(arch.hidden_size, 0, 1).float()))
    plain = torch.nn.Linear(64, 320, bias=False)
    assert float32_logits_head(plain) is plain  # torch's float32 linear: nothing to change


def _q8_0_rows(vocab_size: int) -> torch.Tensor:
    """GGUF Q8_0 rows of 64 inputs (two blocks: fp16 scale, 32 int8): A and B are 30 = 0.25 * 120 at
    input 0; B also 0.0625 * 1 at input 33."""
    rows = bytearray()
    for token in range(vocab_size):
        for block in range(2):
            scale, values = 0.0, [0] * 32
            if token in (A, B) and block == 0:
                scale, values[0] = 0.25, 120
            if token == B and block == 1:
                scale, values[1] = 0.0625, 1
            rows += struct.pack("<e32b", scale, *values)
    return torch.frombuffer(rows, dtype=torch.uint8).view(vocab_size, -1).clone()


@pytest.mark.skipif(not HAS_BF16_KERNELS, reason="needs AVX512-BF16")
def test_a_gguf_q8_0_head_keeps_the_float32_argmax():
    """The shipped SmolLM2's head: its tied Q8_0 embedding, multiplied in the blocks."""
    stored = StoredTensor("q8_0", _q8_0_rows(320), (320, 64), "lm_head.weight")
    head = float32_logits_head(NativeWeights(bf16_native_kernel()).linear([stored]))
    _assert_float32_argmax(head(_inputs(64, 0, 33)))


def test_without_kernels_a_float32_copy_of_the_weight():
    head = Float32Head(_near_tie_weight(320, 64).to(BF16))
    _assert_float32_argmax(head(_inputs(64, 0, 1)))
    _assert_float32_argmax(ReusedRows(head)(_inputs(64, 0, 1)))


@pytest.mark.cuda
def test_cuda_head_writes_float32_sums():
    head = CudaHead(_near_tie_weight(320, 64).to(device="cuda", dtype=BF16))
    _assert_float32_argmax(head(_inputs(64, 0, 1).cuda()).cpu())


def test_a_head_with_a_bias_has_no_float32_form():
    with pytest.raises(TypeError, match="no float32-logits form"):
        float32_logits_head(torch.nn.Linear(4, 4).to(BF16))


def test_reused_rows_follow_the_head_s_output_dtype():
    """A benchmark switches the head to bfloat16 output (`asyncpp.bench.logits_cost`): the rows it
    writes are then bfloat16 ones, kept apart from the float32 ones."""
    weight = _near_tie_weight(320, 64).to(BF16)
    head = QLinearHead(weight, qlinear_kernel()) if qlinear_kernel() is not None else None
    if head is None:
        pytest.skip("no C compiler")
    rows = ReusedRows(head)
    x = _inputs(64, 0, 1)
    float32 = rows(x)
    head.out_dtype = torch.bfloat16  # QLinearHead writes float32 only: the out tensor decides nothing
    with pytest.raises(ValueError, match="float32"):
        rows(x)
    head.out_dtype = torch.float32
    assert rows(x).data_ptr() == float32.data_ptr()
