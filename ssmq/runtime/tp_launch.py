"""Starting a tensor-parallel job: the process group (with a timeout), a watchdog, sharded loading.

Launched as ``torchrun --nproc_per_node N -m ssmq <cmd> ... --tp N``: torchrun sets RANK, WORLD_SIZE,
LOCAL_RANK and MASTER_ADDR/PORT; every rank runs the same command and rank 0 prints.

Failure handling (a dead or hung rank never leaves the job hanging):
- the process group has a timeout (``timeout_s``): a collective that a peer never joins raises
  after it (gloo), or is aborted by NCCL's watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING);
- ``Watchdog``: a thread that ends the process with one line on stderr when the main thread has not
  reported progress (``beat()``) for ``hang_s`` seconds, e.g. a rank stuck outside any collective;
- ``guarded(fn)`` turns any exception on a rank into one line ``ssmq: error: rank R: ...`` and exit 1;
  torchrun then stops the other ranks.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ssmq.errors import SSMQError

DEFAULT_TIMEOUT_S = 300.0
# NVLink multicast stays off on the shared GPU machines (see README): set here too for local runs
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def init_tp(tp: int, device: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, init_method: str | None = None,
            rank: int | None = None, world: int | None = None):
    """Join (or start) the process group of ``tp`` ranks; returns (rank, world, device).

    Without ``rank``/``world``, reads torchrun's environment. Device: cuda:LOCAL_RANK when CUDA is
    available (NCCL), else cpu (gloo).
    """
    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)
    if rank is None:
        if "WORLD_SIZE" not in os.environ:
            raise SSMQError(f"--tp {tp} needs one process per rank: launch with "
                            f"torchrun --nproc_per_node {tp} -m ssmq ... --tp {tp}")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != tp:
        raise SSMQError(f"--tp {tp} but {world} processes were started (torchrun --nproc_per_node {tp})")
    local = int(os.environ.get("LOCAL_RANK", rank))
    if device is None:
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    elif device == "cuda":
        device = f"cuda:{local}"
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    if not dist.is_initialized():
        kw = {"init_method": init_method} if init_method else {}
        if backend == "nccl":
            kw["device_id"] = torch.device(device)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kw)
    return rank, world, device


@torch.no_grad()
def load_tp_model(path, comm, dtype: torch.dtype = torch.float32, device="cpu", fuse_norm: bool = True):
    """Load a float or quantized checkpoint and keep this rank's shard.

    The checkpoint is read on the CPU (host memory), sharded there, and only the shard moves to
    ``device``: no rank ever holds the whole model on its GPU.
    """
    from ssmq.quant import load_model  # float or quantized folders
    from ssmq.runtime.tp import apply_tp, check_tp

    model = load_model(path, dtype=dtype, device="cpu")
    check_tp(model.config, comm.world)
    apply_tp(model, comm, fuse_norm=fuse_norm)
    return model.to(device).eval()


class Watchdog:
    """Ends the process (exit 1, one line on stderr) when ``beat()`` was not called for ``hang_s`` seconds."""

    def __init__(self, hang_s: float, rank: int, what: str = "tensor-parallel job"):
        self.hang_s, self.rank, self.what = hang_s, rank, what
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()

    def beat(self) -> None:
        self._last = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.hang_s / 4)):
            if time.monotonic() - self._last > self.hang_s:
                sys.stderr.write(f"ssmq: error: rank {self.rank}: no progress for {self.hang_s:.0f} s in the "
                                 f"{self.what} (a rank died or hangs); stopping\n")
                sys.stderr.flush()
                os._exit(1)


def failure_line(e: BaseException, rank: int) -> str:
    """One line for an exception on a rank; collective failures say that a peer died or hangs."""
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    low = msg.lower()
    if isinstance(e, dist.DistError) or "timed out" in low or "timeout" in low or "connection" in low:
        msg = f"a collective did not complete (a peer rank died or hangs): {msg}"
    return f"ssmq: error: rank {rank}: {msg}"


def guarded(fn, rank: int):
    """Run fn(); any exception becomes one line on stderr and exit status 1 (torchrun stops the others)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the whole point: one clear line per failing rank
        sys.stderr.write(failure_line(e, rank) + "\n")
        sys.stderr.flush()
        os._exit(1)


def add_tp_args(p) -> None:
    """--tp and the all-reduce options, shared by ``ssmq generate`` and ``ssmq eval``."""
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree; launch with "
                   "torchrun --nproc_per_node N -m ssmq ... --tp N (default 1)")
    p.add_argument("--allreduce", default="auto", choices=["auto", "nccl", "oneshot"],
                   help="TP all-reduce: auto = one-shot over peer memory for small messages, else NCCL (default auto)")
    p.add_argument("--allreduce-payload", default="none", choices=["none", "bf16", "int8"],
                   help="quantize what the TP all-reduce sends: bf16, or int8 with a scale per 128 values "
                        "(default none)")
    p.add_argument("--tp-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds before a collective that a rank never joins fails the job (default %(default)s)")


def check_tp_degree(n: int) -> int:
    """``n`` if it is a valid --tp degree (>= 1), else a one-line error."""
    if n < 1:
        raise SSMQError(f"--tp must be >= 1, got {n}")
    return n


def start_tp(args, device: str | None = None):
    """(Communicator, device) for ``--tp N`` > 1 (joins torchrun's group), else (None, device).

    Only rank 0 prints: the other ranks' stdout goes to /dev/null.
    """
    from ssmq.runtime.tp_comm import Communicator

    if check_tp_degree(getattr(args, "tp", 1)) == 1:
        return None, device
    rank, world, device = init_tp(args.tp, device=device, timeout_s=args.tp_timeout)
    comm = Communicator(mode=args.allreduce, payload=args.allreduce_payload, device=device)
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    return comm, device
