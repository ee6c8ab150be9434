import math

import pytest
import torch

from ssmq.errors import SSMQError
from ssmq.quant.observers import HistogramObserver, MinMaxObserver, MSEObserver, PercentileObserver, make_observer
from ssmq.quant.primitives import PerChannel


def _stream(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 50, 8, generator=g) * torch.arange(1, 9) for _ in range(10)]


def test_minmax_per_channel():
    xs = _stream()
    ob = MinMaxObserver(PerChannel(-1))
    for x in xs:
        ob.update(x)
    allx = torch.cat([x.reshape(-1, 8) for x in xs])
    lo, hi = ob.range()
    assert torch.equal(lo, allx.amin(0)) and torch.equal(hi, allx.amax(0))
    s, z = ob.qparams("int8")
    assert s.shape == (8,) and z is None


def test_percentile_exact_in_top_capacity():
    xs = _stream()
    allv = torch.cat([x.reshape(-1) for x in xs]).abs()
    for p in (99.9, 99.0):
        ob = PercentileObserver(p=p, capacity=512, reservoir=256)
        for x in xs:
            ob.update(x)
        r = math.ceil((1 - p / 100) * allv.numel())
        assert ob.range()[1].item() == allv.sort(descending=True).values[r - 1].item()


def test_percentile_reservoir_estimate_and_memory():
    xs = _stream()
    ob = PercentileObserver(p=50.0, capacity=16, reservoir=2000)
    for x in xs:
        ob.update(x)
    assert ob.tails[0].top.numel() == 16 and ob.tails[0].sample.numel() == 2000  # bounded memory
    true = torch.cat([x.reshape(-1) for x in xs]).abs().quantile(0.5).item()
    assert abs(ob.range()[1].item() - true) < 0.1 * true


def test_percentile_asymmetric_per_channel():
    ob = PercentileObserver(PerChannel(-1), p=100.0, symmetric=False)
    xs = _stream()
    for x in xs:
        ob.update(x)
    allx = torch.cat([x.reshape(-1, 8) for x in xs])
    lo, hi = ob.range()
    assert torch.equal(hi, allx.amax(0)) and torch.equal(lo, allx.amin(0))
    s, z = ob.qparams("int8", symmetric=False)
    assert z.dtype == torch.int32 and s.shape == (8,)


def test_histogram_growth_and_percentile():
    ob = HistogramObserver(bins=1024)
    ob.update(torch.linspace(-1, 1, 1001))
    ob.update(torch.linspace(-10, 10, 1001))  # range grows 1 -> 16: counts merge, none lost
    assert ob.hist.sum().item() == 2002
    assert ob.range()[1].item() == 10.0
    p = ob.percentile(99.0)
    assert 9.5 < p.item() <= 10.0


def test_mse_clips_outliers():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100000, generator=g)
    x[:5] = 80.0  # a few outliers
    mse = MSEObserver(qtype="int4")
    mse.update(x)
    c = mse.range()[1].item()
    assert 1.0 < c < 40.0  # clips the outliers; keeps the bulk


def test_make_observer_refusals():
    with pytest.raises(SSMQError):
        make_observer("nope")
    with pytest.raises(SSMQError):
        make_observer("mse", symmetric=False)
    with pytest.raises(SSMQError, match="saw no data"):
        MinMaxObserver().range()
