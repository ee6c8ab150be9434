"""What the device sweep scripts (``device_qgemm_mid.py``, ``device_qgemm_a8.py``) share: their log, the parallel
compile-and-check of every point, and weight copies that together exceed the L2."""

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
