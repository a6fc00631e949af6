"""oneDNN-packed bfloat16 linear layers: batch invariant, and the same numbers as `F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncpp.model.packed_linear import PackedLinear, can_pack

BF16 = torch.bfloat16

pytestmark = pytest.mark.skipif(not can_pack("cpu", BF16), reason="no oneDNN bfloat16 linear on this CPU")

# (out_features, in_features) of SmolLM2-135M's q/o, k/v, gate+up and down projections.
SHAPES = [(576, 576), (192, 576), (3072, 576), (576, 1536)]


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_rows_do_not_depend_on_the_batch(threads, shape):
    g = torch.Generator().manual_seed(shape[0] + shape[1])
    layer = PackedLinear((0.05 * torch.randn(shape, generator=g)).to(BF16))
    x = torch.randn(300, shape[1], generator=g).to(BF16)
    whole = layer(x)
    for rows in (1, 2, 3, 7, 64):
        batched = torch.cat([layer(x[s : s + rows]) for s in range(0, x.shape[0], rows)])
        differing = int((batched != whole).any(dim=1).sum())
        assert differing == 0, f"{differing} rows change when computed {rows} at a time"


def test_same_numbers_as_f_linear():
    g = torch.Generator().manual_seed(0)
    weight = (0.05 * torch.randn(576, 1536, generator=g)).to(BF16)
    x = torch.randn(64, 1536, generator=g).to(BF16)
    assert torch.equal(PackedLinear(weight)(x), F.linear(x, weight))
