"""Per-kernel profile of one decode step: which kernels a step runs, how often, and how much of the step's time
each takes, beside the step's own time. The difference between the step and the sum of its kernels is the time
the GPU spent between kernels (launch gaps, ramps and tails that no kernel's own time shows).

On CUDA the step is what ``ssmq generate`` replays (a CUDA graph, here captured without programmatic dependent
launch, which would let each kernel's recorded time include its predecessor's tail) and the profiler records every
kernel of the replay with its device time; on the CPU the rows are the step's PyTorch operators (self CPU time), which only
shows that the profile runs.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

TOP = 14  # kernels listed by name; the rest are summed into one "other" row


def _short(name: str) -> str:
    """A kernel's name without template arguments and parameter lists (Triton names stay as they are)."""
    for stop in ("<", "("):
        name = name.split(stop, 1)[0]
    return name.removeprefix("void ").strip()[:80]


def kernel_profile(step: Callable[[], object], device: torch.device, step_ms: float, steps: int = 8) -> list[dict]:
    """Profile ``steps`` calls of ``step`` (one decode step each) → rows ``{"kernel", "calls", "us", "share"}`` per
    step, longest first: the ``TOP`` longest kernels, "other", "kernels (sum)", then "between kernels" (``step_ms``
    minus the kernels' sum; negative when kernels overlap, as with programmatic dependent launch).

    step_ms: the step's time measured without the profiler (its overhead would inflate the gaps)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    step()  # compiled and captured before recording
    if cuda:
        torch.cuda.synchronize(device)
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if cuda and ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        name = _short(ev.name)
        # self time on the CPU: a parent operator's own time without its children's, so nothing counts twice
        us[name] += (ev.time_range.elapsed_us() if cuda else ev.self_cpu_time_total) / steps
        calls[name] += 1
    ranked = sorted(us, key=us.get, reverse=True)
    total = sum(us.values())
    step_us = step_ms * 1e3
    rows = [{"kernel": k, "calls": calls[k] / steps, "us": us[k]} for k in ranked[:TOP]]
    if len(ranked) > TOP:
        rest = ranked[TOP:]
        rows.append({"kernel": f"other ({len(rest)} names)", "calls": sum(calls[k] for k in rest) / steps,
                     "us": sum(us[k] for k in rest)})
    rows.append({"kernel": "kernels (sum)", "calls": sum(calls.values()) / steps, "us": total})
    rows.append({"kernel": "between kernels", "calls": None, "us": step_us - total})
    for r in rows:
        r["share"] = r["us"] / step_us if step_us > 0 else None
    return rows
