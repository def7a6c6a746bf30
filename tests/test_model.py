"""Model building blocks that the oracle tests cover only through whole-model outputs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.server.models.layers import SMALL_BATCH_ROWS, Linear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 33])
def test_linear_equals_f_linear_at_every_batch_size(rows, bias):
    torch.manual_seed(rows)
    layer = Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    y = layer(x)
    assert y.shape == (rows, 160) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_linear_keeps_leading_dimensions_of_batched_input():
    layer = Linear(8, 4, bias=True)
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
