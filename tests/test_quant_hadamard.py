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


@pytest.mark.parametrize("n", [16, 12, 40, 768, 5120, 8192])
def test_gemm_transform_matches_butterflies(n):
    """The two-GEMM form CUDA runs (Kronecker factors) is the same transform as the butterflies: exact in float64,
    within float32 rounding in float32; in the input's dtype and shape."""
    from ssmq.quant.hadamard import hadamard_transform_gemm

    x = torch.randn(2, 3, n, dtype=torch.float64)
    torch.testing.assert_close(hadamard_transform_gemm(x), hadamard_transform(x), rtol=0, atol=1e-12)
    x32 = x.float()
    got = hadamard_transform_gemm(x32)
    assert got.dtype == torch.float32 and got.shape == x32.shape
    torch.testing.assert_close(got, hadamard_transform(x32), rtol=1e-5, atol=1e-5)
    x16 = x32.half()  # float16 is transformed in float16: within a few float16 ulps of the exact transform
    got16 = hadamard_transform_gemm(x16)
    assert got16.dtype == torch.float16
    torch.testing.assert_close(got16.double(), hadamard_transform(x16.double()), rtol=4e-3, atol=4e-3)


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


@pytest.mark.gpu
def test_cuda_transform_equals_cpu_and_replays_in_a_graph():
    """On CUDA (the GEMM form, float16 on tensor cores): equal to the CPU butterflies within a few float16 ulps,
    and capturable (its ±1 factors are cached on the device by the eager call before the capture, no host copy
    inside it)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.randn(4, 5120)
    xd = x.cuda().half()
    ref = hadamard_transform(xd.float().cpu())
    torch.testing.assert_close(hadamard_transform(xd).float().cpu(), ref, rtol=4e-3, atol=4e-3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = hadamard_transform(xd)
    xd.copy_((x * 2).cuda().half())
    graph.replay()
    torch.testing.assert_close(out.float().cpu(), hadamard_transform(xd.float().cpu()), rtol=4e-3, atol=4e-3)
