"""What the device sweep scripts (``device_qgemm_mid.py``, ``device_qgemm_a8.py``) share: their log, the parallel
compile-and-check of every point, weight copies that together exceed the L2, the timing of the points that compiled,
and the route a kernel's wins make."""

import json
import math
import multiprocessing as mp
import time

import torch


def logger(out_dir: str):
    """say(*values): print a line and append it to OUT_DIR/sweep_log.txt."""
    log = open(f"{out_dir}/sweep_log.txt", "w")

    def say(*values):
        line = " ".join(str(v) for v in values)
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    return say


def compile_points(compile_chunk, jobs: list, workers: int, say, shapes: int, shown: int = 30) -> set:
    """Compile (and check against the reference) every (code, rows, settings) job in ``workers`` spawned processes
    (Triton's disk cache keeps the builds); ``compile_chunk(jobs)`` -> [(code, rows, settings, shape, why)] of those
    that failed. Returns the failed points as {(code, rows, settings as JSON)}."""
    t0 = time.time()
    chunks = [jobs[i::workers] for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        bad = [b for part in pool.map(compile_chunk, chunks) for b in part]
    for b in bad[:shown]:
        say("  FAILED", b)
    failed = {(c, r, json.dumps(o, sort_keys=True)) for c, r, o, _, _ in bad}
    say(f"compiled {len(jobs)} points x {shapes} shapes in {time.time() - t0:.0f} s; {len(failed)} failed")
    return failed


def weight_copies(make, device: torch.device) -> list:
    """``make(seed)`` -> a tuple of weight tensors, called for as many seeds as make the copies together at least
    twice the L2: timed calls that rotate through them read every weight from HBM, as a model's step does."""
    one = make(0)
    nbytes = sum(t.numel() * t.element_size() for t in one)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return [one] + [make(seed) for seed in range(1, max(1, math.ceil(2 * l2 / nbytes)))]


def time_points(points: list, failed: set, time_point, shapes, say, t0: float) -> tuple[dict, list]:
    """Time every (code, rows, settings) point that compiled: ``time_point(code, shape, rows, settings)`` -> µs, for
    each of ``shapes``; a point whose timing raises is reported and left out. Says the three fastest points of each
    (code, rows) by summed time, and returns ({(code, rows): the fastest point}, every timed point)."""
    best, res = {}, []
    for code, rows, over in points:
        if (code, rows, json.dumps(over, sort_keys=True)) in failed:
            continue
        try:
            ts = [time_point(code, name, rows, over) for name in shapes]
        except Exception as e:
            say("  TIMING FAILED", code, rows, over, f"{type(e).__name__}: {str(e)[:120]}")
            continue
        res.append(dict(code=code, rows=rows, over=over, us=ts))
        if (code, rows) not in best or sum(ts) < sum(best[(code, rows)]["us"]):
            best[(code, rows)] = res[-1]
    say(f"timed {len(res)} points; {time.time() - t0:.0f} s")
    for code, rows in sorted({(c, r) for c, r, _ in points}):
        top = sorted((r for r in res if r["code"] == code and r["rows"] == rows), key=lambda r: sum(r["us"]))[:3]
        for r in top:
            say(f"  {code} {rows:3d} rows: {sum(r['us']):7.1f} us = {' + '.join(f'{t:.1f}' for t in r['us'])}"
                f"  {r['over']}")
    return best, res


def route_of(wins: dict, rows: list, top: int) -> list:
    """[least, most] rows a kernel is routed, from ``wins`` {measured row count: whether it beat the old path}: from
    the first count it won at (or from one past the count before it) through the consecutive wins after it (``top``
    when they reach the last count); [1, 0] (no rows) when it never won."""
    lo = next((i for i, m in enumerate(rows) if wins[m]), None)
    if lo is None:
        return [1, 0]
    hi = lo
    while hi + 1 < len(rows) and wins[rows[hi + 1]]:
        hi += 1
    return [rows[lo] if lo == 0 else rows[lo - 1] + 1, rows[hi] if hi + 1 < len(rows) else top]
