"""Run a function on W processes joined by gloo on CPU, or by NCCL on W GPUs (tensor-parallel tests), collecting
each rank's result.

``run_ranks(fn, world, *args)`` spawns W processes; each joins the group, builds its Communicator and
returns ``fn(comm, *args)`` (torch-saveable). Functions must live in an importable module (spawn).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
from pathlib import Path

import torch


def _worker(rank, world, init_file, out_dir, fn, args, comm_kw, timeout_s, device):
    torch.set_num_threads(1)
    import torch.distributed as dist

    from ssmq.runtime.tp_comm import Communicator
    from ssmq.runtime.tp_launch import init_tp

    shared = device == "cuda:shared"
    _, _, dev = init_tp(world, device="cpu" if shared else device, init_method=f"file://{init_file}", rank=rank,
                        world=world, timeout_s=timeout_s)
    if shared:  # gloo moves the CUDA tensors' collectives through host memory
        torch.cuda.set_device(0)
        dev = "cuda:0"
    if device.startswith("cuda"):
        comm_kw = {"device": dev, **comm_kw}
    result = fn(Communicator(**{"mode": "nccl", **comm_kw}), *args)
    torch.save(result, Path(out_dir) / f"{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(fn, world: int, *args, comm_kw=None, timeout_s: float = 60.0, join_s: float = 300.0,
              device: str = "cpu"):
    """Results of fn on every rank, rank order; AssertionError with the exit codes when a rank fails. ``device``
    "cuda": rank r on GPU r, NCCL; "cuda:shared": every rank on GPU 0, gloo (the sharded kernels' shapes of W GPUs
    on one, slowly)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_worker, args=(r, world, init, tmp, fn, args, comm_kw or {}, timeout_s, device))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(join_s)
        codes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
        assert codes == [0] * world, f"ranks exited with {codes}"
        return [torch.load(Path(tmp) / f"{r}.pt", weights_only=False) for r in range(world)]


def _failing_worker(rank, world, init_file, log, fn, timeout_s):
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    from ssmq.runtime.tp_comm import Communicator
    from ssmq.runtime.tp_launch import guarded, init_tp

    init_tp(world, device="cpu", init_method=f"file://{init_file}", rank=rank, world=world, timeout_s=timeout_s)
    guarded(lambda: fn(Communicator(mode="nccl")), rank)


def run_until_failure(fn, world: int, timeout_s: float, limit_s: float = 120.0, stop_others: bool = True):
    """Run fn(comm) on every rank as torchrun would: when one rank exits non-zero, stop the others
    (``stop_others=False``: wait until every rank has ended by itself).

    Returns (exit codes, {rank: stderr text}, seconds until the first failure, or until all ended).
    """
    import time

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        logs = [os.path.join(tmp, f"{r}.log") for r in range(world)]
        procs = [ctx.Process(target=_failing_worker, args=(r, world, os.path.join(tmp, "init"), logs[r], fn, timeout_s))
                 for r in range(world)]
        for p in procs:
            p.start()
        start = time.monotonic()
        while time.monotonic() - start < limit_s:
            failed = stop_others and any(p.exitcode not in (None, 0) for p in procs)
            if failed or all(p.exitcode is not None for p in procs):
                break
            time.sleep(0.2)
        elapsed = time.monotonic() - start
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        return [p.exitcode for p in procs], {r: open(logs[r]).read() for r in range(world)}, elapsed
