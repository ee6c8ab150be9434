"""Observers: streaming range statistics of activations, turned into quantization parameters.

Every observer takes ``update(x)`` any number of times (x of any shape), then gives
``range() -> (lo, hi)`` and ``qparams(qtype, symmetric) -> (scale, zero_point)`` through
``primitives.qparams_from_range``, so clipping and quantization share one formula.

Granularity: ``PerTensor()`` (stats shaped (), one value) or ``PerChannel(axis)`` (stats shaped
(C,), C = x.shape[axis]; activations use axis -1). Internally x is viewed as rows (C, N).

Kinds (``make_observer``):
    "absmax"/"minmax"  running min and max (exact)
    "percentile"       p-th percentile of |x| (or of x and -x when asymmetric), bounded memory
    "histogram"        histogram of |x| with a doubling range; range = absmax, or a percentile
    "mse"              histogram + the clipping value minimising the expected squared
                       quantization error of the histogram (symmetric only)
"""

from __future__ import annotations

import math

import torch

from ssmq.errors import SSMQError
from ssmq.quant.primitives import (
    EPS,
    PerChannel,
    PerTensor,
    dequantize,
    qparams_from_range,
    quantize,
)


def _rows(x: torch.Tensor, gran) -> torch.Tensor:
    """x (any shape) -> float32 (C, N): one row per channel (C = 1 per tensor)."""
    x = x.detach().float()
    if isinstance(gran, PerTensor):
        return x.reshape(1, -1)
    if isinstance(gran, PerChannel):
        return x.movedim(gran.axis, 0).reshape(x.shape[gran.axis], -1)
    raise SSMQError(f"observers support per_tensor and per_channel, not {gran!r}")


def _canonical(t: torch.Tensor, gran) -> torch.Tensor:
    """(C,) stats -> the canonical scale shape of ``gran`` (() per tensor)."""
    return t.reshape(()) if isinstance(gran, PerTensor) else t


class Observer:
    """Base: subclasses fill ``_update(rows (C, N))`` and ``_range() -> (lo (C,), hi (C,))``."""

    def __init__(self, gran=PerTensor()):
        self.gran = gran
        self.count = 0  # values seen per channel

    def update(self, x: torch.Tensor) -> None:
        rows = _rows(x, self.gran)
        if rows.numel() == 0:
            return
        self._update(rows)
        self.count += rows.shape[1]

    def range(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.count == 0:
            raise SSMQError(f"{type(self).__name__} saw no data (was the hooked module ever called?)")
        lo, hi = self._range()
        return _canonical(lo, self.gran), _canonical(hi, self.gran)

    def qparams(self, qtype: str = "int8", symmetric: bool = True):
        lo, hi = self.range()
        return qparams_from_range(lo, hi, qtype, symmetric)

    def _update(self, rows: torch.Tensor) -> None:
        raise NotImplementedError

    def _range(self):
        raise NotImplementedError


class MinMaxObserver(Observer):
    """Running min / max; symmetric qparams use max(|min|, |max|) = absmax."""

    def __init__(self, gran=PerTensor()):
        super().__init__(gran)
        self.lo = self.hi = None

    def _update(self, rows):
        lo, hi = rows.amin(1), rows.amax(1)
        self.lo = lo if self.lo is None else torch.minimum(self.lo, lo)
        self.hi = hi if self.hi is None else torch.maximum(self.hi, hi)

    def _range(self):
        return self.lo, self.hi


class _Tail:
    """Bounded-memory estimate of upper percentiles of a stream of rows (C, N).

    Keeps (a) the ``capacity`` largest values per row exactly and (b) a uniform random sample
    of ``reservoir`` values per row (bottom-k of i.i.d. uniform keys, so merging batches keeps it
    uniform without replacement). The p-th percentile is the r-th largest value with
    r = ceil((1 - p/100) * count): exact while r <= capacity (e.g. p = 99.999 up to 4e8
    values per row with the default 4096), otherwise estimated from the sample.
    """

    def __init__(self, capacity: int, reservoir: int, seed: int):
        self.capacity, self.reservoir = capacity, reservoir
        self.gen = None
        self.seed = seed
        self.top = self.sample = self.keys = None

    def update(self, rows: torch.Tensor) -> None:
        top = rows if self.top is None else torch.cat((self.top, rows), 1)
        self.top = top.topk(min(self.capacity, top.shape[1]), dim=1).values  # sorted, largest first
        if self.gen is None:
            self.gen = torch.Generator(device=rows.device).manual_seed(self.seed)
        keys = torch.rand(rows.shape, generator=self.gen, device=rows.device)
        if self.sample is not None:
            keys, rows = torch.cat((self.keys, keys), 1), torch.cat((self.sample, rows), 1)
        idx = keys.topk(min(self.reservoir, keys.shape[1]), dim=1, largest=False).indices
        self.keys, self.sample = keys.gather(1, idx), rows.gather(1, idx)

    def percentile(self, p: float, count: int) -> torch.Tensor:
        """(C,) estimate of the p-th percentile (0 < p <= 100)."""
        r = max(1, math.ceil((1.0 - p / 100.0) * count))
        if r <= self.top.shape[1]:
            return self.top[:, r - 1]
        return torch.quantile(self.sample, p / 100.0, dim=1, interpolation="higher")


class PercentileObserver(Observer):
    """Clips at the p-th percentile of |x| (symmetric) or of x and -x (asymmetric).

    Memory per channel: ``capacity`` + 2 * ``reservoir`` floats per tail, whatever the
    stream length; see ``_Tail`` for when the result is exact. Deterministic (seeded sample).
    """

    def __init__(self, gran=PerTensor(), p: float = 99.999, symmetric: bool = True,
                 capacity: int = 4096, reservoir: int = 4096, seed: int = 20240917):
        super().__init__(gran)
        if not 0.0 < p <= 100.0:
            raise SSMQError(f"percentile must be in (0, 100], got {p}")
        self.p, self.symmetric = p, symmetric
        self.tails = [_Tail(capacity, reservoir, seed + i) for i in range(1 if symmetric else 2)]

    def _update(self, rows):
        if self.symmetric:
            self.tails[0].update(rows.abs())
        else:
            self.tails[0].update(rows)
            self.tails[1].update(-rows)

    def _range(self):
        hi = self.tails[0].percentile(self.p, self.count)
        lo = -hi if self.symmetric else -self.tails[1].percentile(self.p, self.count)
        return lo, hi


class HistogramObserver(Observer):
    """Histogram of |x| per channel over [0, R) with ``bins`` equal bins.

    R starts at the first batch's absmax and doubles as needed (pairs of bins merge exactly,
    so no count is ever re-estimated). ``range()`` is the exact absmax, or the ``percentile``
    read off the histogram (upper edge of the bin holding it, i.e. never clips more than asked).
    Values are assumed at their bin's centre in ``mse_clip``. Symmetric only.
    """

    def __init__(self, gran=PerTensor(), bins: int = 2048, percentile: float | None = None):
        super().__init__(gran)
        if bins < 2 or bins & (bins - 1):
            raise SSMQError(f"histogram bins must be a power of two >= 2, got {bins}")
        self.bins, self.p = bins, percentile
        self.hist = self.edge = self.absmax = None  # (C, bins) float64, (C,), (C,)

    def _update(self, rows):
        v = rows.abs()
        amax = v.amax(1)
        if self.hist is None:
            self.edge = amax.clamp(min=EPS)
            self.hist = torch.zeros(rows.shape[0], self.bins, dtype=torch.float64, device=rows.device)
            self.absmax = amax
        else:
            self.absmax = torch.maximum(self.absmax, amax)
            self._grow(amax)
        idx = (v / self.edge.unsqueeze(1) * self.bins).long().clamp(max=self.bins - 1)
        self.hist.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float64))

    def _grow(self, amax):
        # doublings needed per channel so that amax < edge
        e = torch.ceil(torch.log2(amax / self.edge)).clamp(min=0).long()
        e = torch.where(amax >= self.edge * 2.0 ** e, e + 1, e).clamp(max=int(math.log2(self.bins)))
        for k in e.unique().tolist():
            if k == 0:
                continue
            c = (e == k).nonzero().squeeze(1)
            f = 2**k
            merged = self.hist[c].reshape(len(c), self.bins // f, f).sum(-1)
            self.hist[c] = torch.nn.functional.pad(merged, (0, self.bins - self.bins // f))
            self.edge[c] = self.edge[c] * f
        # channels that needed more doublings than there are bin levels: all counts sit in bin 0
        big = amax >= self.edge
        if big.any():
            self.edge[big] = amax[big] * 2.0

    def centers(self) -> torch.Tensor:
        """(C, bins) bin centres."""
        j = torch.arange(self.bins, device=self.edge.device, dtype=torch.float32) + 0.5
        return j.unsqueeze(0) * (self.edge / self.bins).unsqueeze(1)

    def percentile(self, p: float) -> torch.Tensor:
        """(C,) upper edge of the bin where the cumulative count reaches p percent."""
        cdf = self.hist.cumsum(1)
        target = cdf[:, -1:] * (p / 100.0)
        j = (cdf < target).sum(1).clamp(max=self.bins - 1)
        return torch.minimum((j + 1).float() * self.edge / self.bins, self.absmax)

    def mse_clip(self, qtype: str = "int8", candidates: int = 256) -> torch.Tensor:
        """(C,) clipping value c in (0, absmax] minimising sum_bins count * (x - Q_c(x))^2.

        Q_c is symmetric quantization with scale from range [-c, c] (``qparams_from_range``).
        """
        out = torch.empty_like(self.absmax)
        frac = torch.arange(1, candidates + 1, dtype=torch.float32, device=self.edge.device) / candidates
        centers = self.centers()
        for ch in range(self.hist.shape[0]):  # channel by channel: (candidates, bins) at a time
            x = centers[ch].expand(candidates, -1)
            c = frac * self.absmax[ch].clamp(min=EPS)
            scale, _ = qparams_from_range(-c, c, qtype, True)
            xq = dequantize(quantize(x, scale, None, PerChannel(0), qtype), scale, None, PerChannel(0))
            err = ((x - xq) ** 2).double() @ self.hist[ch]
            out[ch] = c[err.argmin()]
        return out

    def _range(self):
        hi = self.absmax if self.p is None else self.percentile(self.p)
        return -hi, hi


class MSEObserver(HistogramObserver):
    """Histogram observer whose range is the MSE-optimal clipping for ``qtype``."""

    def __init__(self, gran=PerTensor(), qtype: str = "int8", bins: int = 2048, candidates: int = 256):
        super().__init__(gran, bins)
        self.qtype, self.candidates = qtype, candidates

    def _range(self):
        c = self.mse_clip(self.qtype, self.candidates)
        return -c, c


OBSERVERS = ("absmax", "minmax", "percentile", "histogram", "mse")


def make_observer(kind: str, gran=PerTensor(), qtype: str = "int8", symmetric: bool = True,
                  percentile: float = 99.999, **kw) -> Observer:
    """Observer by name (the names recipes use)."""
    if kind in ("absmax", "minmax"):
        return MinMaxObserver(gran)
    if kind == "percentile":
        return PercentileObserver(gran, percentile, symmetric, **kw)
    if kind in ("histogram", "mse") and not symmetric:
        raise SSMQError(f"the {kind} observer is symmetric only")
    if kind == "histogram":
        return HistogramObserver(gran, percentile=None if percentile >= 100 else percentile, **kw)
    if kind == "mse":
        return MSEObserver(gran, qtype, **kw)
    raise SSMQError(f"unknown observer {kind!r}; known: {', '.join(OBSERVERS)}")
