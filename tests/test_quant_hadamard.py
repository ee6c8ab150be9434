import math

import pytest
import torch
import torch.nn as nn

from ssmq.errors import SSMQError
from ssmq.quant.hadamard import (
    RotatedLinear, hadamard_matrix, hadamard_transform, rotate_input_, rotate_output_, split_order,
)


@pytest.mark.parametrize("n,base", [(12, 12), (20, 20), (28, 28), (36, 36), (44, 44), (40, 20), (64, 1),
                                    (768, 12), (1536, 12), (1280, 20), (2560, 20), (5120, 20), (896, 28)])
def test_orthogonal(n, base):
    assert split_order(n)[1] == base
    H = hadamard_matrix(n).float()  # +-1 entries, integer sums < 2^24: float32 products are exact
    assert torch.equal(H.abs(), torch.ones(n, n))
    assert torch.equal(H @ H.T, n * torch.eye(n))


@pytest.mark.parametrize("n", [16, 12, 40, 768, 5120])
def test_fast_transform_matches_matrix(n):
    x = torch.randn(3, n, dtype=torch.float64)
    ref = x @ hadamard_matrix(n).double().T / math.sqrt(n)
    torch.testing.assert_close(hadamard_transform(x), ref, rtol=0, atol=1e-12)


def test_unsupported_order_refused():
    with pytest.raises(SSMQError, match="no Hadamard"):
        split_order(92)


def test_fused_linear_pair_equals_unfused():
    torch.manual_seed(0)
    a, b = nn.Linear(64, 768), nn.Linear(768, 48)
    x = torch.randn(10, 64)
    ref = b(torch.relu(a(x)))
    # rotate the hidden width: a writes Q h, b reads it back; relu does not commute, so rotate b's input online
    b2 = RotatedLinear.from_linear(b)
    out = b2(torch.relu(a(x)))
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-5
    # offline fusion on both sides of a purely linear pair
    a3, b3 = nn.Linear(64, 768), nn.Linear(768, 48)
    a3.load_state_dict(a.state_dict()), b3.load_state_dict(b.state_dict())
    rotate_output_(a3)
    rotate_input_(b3)
    ref2 = b(a(x))
    assert ((b3(a3(x)) - ref2).norm() / ref2.norm()).item() <= 1e-5
