import pytest
import torch

from ssmq.errors import SSMQError
from ssmq.quant.primitives import (
    PerChannel, PerGroup, PerTensor, PerToken, choose_qparams, dequantize, granularity_from_str,
    granularity_to_str, int_matmul_ref, pack_int4, quantize, unpack_int4,
)


def test_int_matmul_ref_exact_vs_float64():
    g = torch.Generator().manual_seed(0)
    m, k, n = 7, 256, 9
    a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    a_s, w_s = torch.rand(m, generator=g) + 0.1, torch.rand(n, generator=g) + 0.1
    bias = torch.randn(n, generator=g)
    acc = a.double() @ w.double().T  # exact integers in float64
    ref = (acc.float() * (a_s.view(-1, 1) * w_s.view(1, -1))) + bias
    assert torch.equal(int_matmul_ref(a, a_s, w, w_s, bias=bias), ref)
    # extreme values: the int32 accumulation must not lose anything
    a_max, w_max = torch.full((1, k), -128, dtype=torch.int8), torch.full((1, k), -128, dtype=torch.int8)
    assert int_matmul_ref(a_max, torch.ones(()), w_max, torch.ones(())).item() == 128 * 128 * k


@pytest.mark.parametrize("k,group", [(1024, None), (2048, None), (4096, 1024), (4096, 2048)])
def test_int_matmul_ref_exact_at_float_accumulator_limits(k, group):
    """The float32 accumulation (sums of up to 1024 columns: |acc| <= 2^24) and the float64 one beyond give the
    integers of an int64 GEMM, at the extreme codes too; per group, each group's sum is exact before the epilogue."""
    g = torch.Generator().manual_seed(2)
    a = torch.randint(-128, 128, (6, k), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (5, k), generator=g, dtype=torch.int8)
    a[0], w[0] = -128, -128  # the largest sum: 128 * 128 * (columns summed)
    gs = group or k
    ref = torch.zeros(6, 5)
    for t in range(0, k, gs):  # the epilogue of the contract: out += float32(acc_t) * s_t, s_t = 1
        ref += (a[:, t:t + gs].long() @ w[:, t:t + gs].long().T).float()
    scale = torch.ones(5, k // group) if group else torch.ones(())
    assert torch.equal(int_matmul_ref(a, torch.ones(()), w, scale, group_size=group), ref)


def test_int_matmul_ref_groups_exact():
    g = torch.Generator().manual_seed(1)
    m, k, n, gs = 5, 128, 6, 32
    a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    w = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    a_s, w_s = torch.rand(()) + 0.1, torch.rand(n, k // gs, generator=g) + 0.1
    out = torch.zeros(m, n)
    for t in range(k // gs):
        acc = a[:, t * gs:(t + 1) * gs].double() @ w[:, t * gs:(t + 1) * gs].double().T
        out += acc.float() * (a_s * w_s[:, t].view(1, n))
    assert torch.equal(int_matmul_ref(a, a_s, w, w_s, group_size=gs), out)


def test_int4_pack_roundtrip_and_layout():
    q = torch.randint(-8, 8, (3, 5, 64), dtype=torch.int8)
    p = pack_int4(q)
    assert p.dtype == torch.uint8 and p.shape == (3, 5, 32)
    assert torch.equal(unpack_int4(p), q)
    assert pack_int4(torch.tensor([-1, 2], dtype=torch.int8)).item() == 0x2F  # low nibble = even index


def test_fp8_roundtrip():
    x = torch.randn(64, 32) * 3
    s, z = choose_qparams(x, PerChannel(0), "fp8")
    q = quantize(x, s, z, PerChannel(0), "fp8")
    assert q.dtype == torch.float8_e4m3fn and z is None
    y = dequantize(q, s, z, PerChannel(0))
    assert ((y - x).abs() <= x.abs() * 2**-4 + 1e-6).all()  # e4m3: 3 mantissa bits
    assert torch.equal(quantize(y, s, z, PerChannel(0), "fp8").float(), q.float())  # representable values are fixed points


@pytest.mark.parametrize("gran", [PerTensor(), PerChannel(0), PerToken(), PerGroup(16)])
@pytest.mark.parametrize("qtype", ["int8", "int4"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_roundtrip_error_bounded(gran, qtype, symmetric):
    x = torch.randn(8, 64) * torch.linspace(0.1, 4, 64)
    s, z = choose_qparams(x, gran, qtype, symmetric)
    q = quantize(x, s, z, gran, qtype)
    assert q.dtype == torch.int8
    y = dequantize(q, s, z, gran)
    from ssmq.quant.primitives import broadcast_to
    assert ((y - x).abs() <= broadcast_to(s, x, gran) / 2 + 1e-6).all()
    assert torch.equal(quantize(torch.zeros_like(x), s, z, gran, qtype).float(),
                       torch.zeros_like(x) if z is None else broadcast_to(z, x, gran).float().expand_as(x))


def test_granularity_strings():
    for g in [PerTensor(), PerChannel(0), PerChannel(-1), PerToken(), PerGroup(128)]:
        assert granularity_from_str(granularity_to_str(g)) == g
    with pytest.raises(SSMQError):
        granularity_from_str("per_group:x")
    with pytest.raises(SSMQError):
        choose_qparams(torch.randn(4, 4), PerTensor(), "int3")
