"""The Triton integer stages of SSDi8 equal the reference bit for bit (GPU, or SSMQ_TRITON_INTERPRET=1 on CPU)."""

import pytest
import torch

from test_kernels import DEV, INTERPRET, kernel_module

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def k():
    return kernel_module("ssdi8")


SHAPES = [(1, 2, 16, 4, 16, 2, 16)] if INTERPRET else [(2, 3, 64, 6, 64, 3, 64), (1, 4, 256, 8, 64, 1, 128)]


def codes(*shape, gen):
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=gen).to(DEV)


@pytest.mark.parametrize("shape", SHAPES)
def test_integer_stages_bit_exact(k, shape):
    from ssmq.ops import ssd_int8 as ref

    b, c, T, h, p, g, n = shape
    gen = torch.Generator().manual_seed(0)
    xs, B, C = codes(b, c, T, h, p, gen=gen), codes(b, c, T, g, n, gen=gen), codes(b, c, T, g, n, gen=gen)
    mult = (torch.rand(h, p, generator=gen) * 1e-4).to(DEV)
    assert torch.equal(k.chunk_state_q(xs, B, mult), ref.chunk_state_q(xs.cpu(), B.cpu(), mult.cpu()).to(DEV))
    assert torch.equal(k.chunk_bmm_q(C, B), ref.chunk_bmm_int8(C.cpu(), B.cpu()).to(DEV))
    chunk = codes(b, c, h, p, n, gen=gen)
    decay = torch.randint(0, 129, (b, c, h), dtype=torch.int32, generator=gen).to(DEV)
    init = codes(b, h, p, n, gen=gen)
    for i in (None, init):
        got = k.state_passing_q(chunk, decay, i)
        want = ref.state_passing_int8(chunk.cpu(), decay.cpu(), None if i is None else i.cpu())
        assert all(torch.equal(a, w.to(DEV)) for a, w in zip(got, want))
    lut, ss = torch.rand(b, c, T, h, generator=gen).to(DEV), torch.rand(h, p, generator=gen).to(DEV)
    assert torch.equal(k.chunk_scan_off_q(C, chunk, lut, ss), ref.chunk_scan_off_int8(C.cpu(), chunk.cpu(), lut.cpu(), ss.cpu()).to(DEV))


def test_round_half_even_matches_torch(k):
    """The requantization epilogue rounds ties to even like torch.round (acc·mult exactly on .5)."""
    from ssmq.ops import ssd_int8 as ref

    xs = torch.zeros(1, 1, 16, 1, 16, dtype=torch.int8)
    B = torch.zeros(1, 1, 16, 1, 16, dtype=torch.int8)
    xs[0, 0, 0, 0, :] = torch.arange(-8, 8, dtype=torch.int8)
    B[0, 0, 0, 0, :] = 1
    mult = torch.full((1, 16), 0.5)  # values k / 2: every half-integer tie
    got = k.chunk_state_q(xs.to(DEV), B.to(DEV), mult.to(DEV)).cpu()
    assert torch.equal(got, ref.chunk_state_q(xs, B, mult))


def test_whole_scan_equals_reference(k):
    from ssmq.ops.quant_ssm import quantize_ref
    from ssmq.ops.ssd_int8 import ssd_int8_ranges, ssd_int8_ref

    b, l, h, p, g, n, T = (1, 40, 4, 16, 2, 16, 16) if INTERPRET else (2, 1000, 8, 64, 1, 128, 256)
    gen = torch.Generator().manual_seed(1)
    x, dt = torch.randn(b, l, h, p, generator=gen), torch.randn(b, l, h, generator=gen) - 1
    A, B, C = -torch.rand(h, generator=gen), torch.randn(b, l, g, n, generator=gen), torch.randn(b, l, g, n, generator=gen)
    sc = {kk: v / 127 for kk, v in ssd_int8_ranges(x, dt, A, B, C, T, dt_softplus=True).items()}
    Bq, Cq = quantize_ref(B, sc["B"][:, None]), quantize_ref(C, sc["C"][:, None])
    args = (x, dt, A, Bq, sc["B"], Cq, sc["C"], sc["xs"], sc["state"], T)
    y, f = ssd_int8_ref(*args, dt_softplus=True, return_final_states=True)
    yk, fk = k.ssd_int8(*(a.to(DEV) if torch.is_tensor(a) else a for a in args), dt_softplus=True,
                        return_final_states=True)
    assert torch.equal(fk.cpu(), f)  # the int8 state: integer arithmetic end to end
    torch.testing.assert_close(yk.cpu(), y, rtol=1e-5, atol=1e-5)  # float glue may round differently on a GPU
