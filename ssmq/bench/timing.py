"""One timing helper for every benchmark: CUDA events on a GPU, ``time.perf_counter`` on the CPU."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call of ``reps`` timed calls (after ``warmup`` untimed ones)."""

    median_ms: float
    mean_ms: float
    min_ms: float
    reps: int

    def to_dict(self) -> dict:
        return asdict(self)


_L2: dict[torch.device, torch.Tensor] = {}


def flush_l2(device: torch.device) -> None:
    """Evict the GPU's L2 cache by writing a buffer twice its size (no-op on the CPU)."""
    if device.type != "cuda":
        return
    buf = _L2.get(device)
    if buf is None:
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20) or 64 << 20
        buf = _L2[device] = torch.empty(2 * size, dtype=torch.uint8, device=device)
    buf.zero_()


def time_fn(fn: Callable[[], object], device: torch.device | str = "cpu", warmup: int = 2, reps: int = 10,
            setup: Callable[[], object] | None = None, l2_flush: bool = False) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``reps`` timed ones, ``setup()`` (untimed) before each call.

    On CUDA each call is bracketed by CUDA events (the GPU time of the work it launches); on the CPU by
    ``time.perf_counter``. ``l2_flush`` evicts the L2 cache before each call (kernel timings from cold memory).
    """
    device = torch.device(device)
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    cuda = device.type == "cuda"
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        if setup:
            setup()
        if l2_flush:
            flush_l2(device)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return Timing(statistics.median(times), statistics.fmean(times), min(times), reps)


def wall(device: torch.device | str = "cpu") -> float:
    """Seconds on a monotonic clock after the device's queued work has finished (for end-to-end wall times)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def graph_us(calls: list[Callable[[], object]], reps: int = 5, timings: int = 5) -> float:
    """GPU time of one call, µs: ``calls`` (run once each per replay, e.g. one per weight copy so that together they
    exceed the L2) captured in a CUDA graph, replayed ``reps`` times per timing; the median of ``timings`` timings,
    over ``reps`` × ``len(calls)``. No host launch time is counted. The calls run once on a side stream first, as
    CUDA-graph capture asks (lazy initialisation outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(timings):
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / (reps * len(calls)))
    return statistics.median(ts)


def copy_bandwidth(device: torch.device | str = "cuda", nbytes: int = 1 << 30) -> float:
    """The device's copy bandwidth in bytes/s, counting bytes read plus written: a device-to-device copy of
    ``nbytes``, the median of 20 CUDA-event timings."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * nbytes / (time_fn(lambda: b.copy_(a), device, warmup=1, reps=20).median_ms / 1e3)
