"""``kernels.rotary.rope`` equals ``ops.rope_ref`` (GPU, or SSMQ_TRITON_INTERPRET=1 on CPU): decode and prefill
shapes, full and partial RoPE, long positions, strided inputs and broadcast positions; bad rotary dims refused."""

from __future__ import annotations

import pytest
import torch

from ssmq import ops
from ssmq.errors import SSMQError
from test_kernels import DEV, DTYPES, kernel_module

pytestmark = pytest.mark.gpu

# one rounding to the dtype apart from the reference at most (the kernel may fuse a product into an add)
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module")
def R():
    return kernel_module("rotary")


# (rows, tokens, heads, head dim, rotary dim): SmolLM2's decode, Bamba's partial RoPE in a prefill piece, the trained
# hybrid's 32 of 64 channels, Llama-8B's query heads, an odd head count and a head dim that is not a power of two
SHAPES = [(3, 1, 9, 64, 64), (2, 5, 8, 128, 64), (2, 3, 6, 64, 32), (1, 1, 32, 128, 128), (2, 4, 3, 80, 16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rope_kernel_equals_reference(R, shape, dtype):
    b, l, h, e, r = shape
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(b, l, h, e, generator=g).to(DEV, dtype)
    positions = torch.randint(0, 131072, (b, l), generator=g).to(DEV)  # long contexts: angles up to 1.3e5 rad
    out = R.rope(x, positions, r, 500000.0)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), ops.rope_ref(x, positions, r, 500000.0).float(), rtol=0, atol=ATOL[dtype])
    torch.testing.assert_close(out[..., r:], x[..., r:], rtol=0, atol=0)  # the channels RoPE leaves, bit for bit


def test_rope_kernel_strided_input_and_broadcast_positions(R):
    """A view with a head stride (every other head of a wider tensor) and positions expanded over the rows (stride
    0), as the caches' read paths pass them."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(2, 7, 8, 64, generator=g).to(DEV, torch.float16)
    x = wide[:, :, ::2]
    positions = torch.arange(7, device=DEV).expand(2, 7)
    torch.testing.assert_close(R.rope(x, positions, 64).float(), ops.rope_ref(x, positions, 64).float(), rtol=0,
                               atol=ATOL[torch.float16])


def test_rope_kernel_without_rotary_dim_returns_x_and_refuses_bad_dims(R):
    x = torch.randn(1, 2, 4, 64, device=DEV)
    positions = torch.zeros(1, 2, dtype=torch.long, device=DEV)
    assert R.rope(x, positions, 0) is x
    with pytest.raises(SSMQError, match="must be even and at most"):
        R.rope(x, positions, 33)
    with pytest.raises(SSMQError, match="must be even and at most"):
        R.rope(x, positions, 128)
    with pytest.raises(SSMQError, match="do not match"):
        R.rope(x, positions[:, :1], 64)
