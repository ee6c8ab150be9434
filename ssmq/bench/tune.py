"""``ssmq bench kernels --tune OP``: candidate launch settings of one op timed on the current GPU, the fastest written
to the op's config file (``ssmq/kernels/configs/<op>.json``) under the GPU's name.

Each candidate is a point of the op's grid (``TUNABLE``), set into the kernel module's ``CFG`` in place while the
op's benchmark cases (``ssmq bench kernels``, the ``ssmq`` implementation) are timed with CUDA events from a flushed
L2; the score is the sum of their medians. The entry written is the settings in force with the winner's values.
"""

from __future__ import annotations

import copy
import importlib
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from ssmq.bench.kernels import KERNEL_BENCHES, KernelContext, shape_config
from ssmq.bench.output import record, table, write
from ssmq.bench.timing import time_fn
from ssmq.errors import SSMQError


@dataclass(frozen=True)
class Tunable:
    bench: str  # the ``ssmq bench kernels`` benchmark whose cases are timed
    grid: dict  # a settings path ("a/b": entry b of entry a) -> the values tried


TUNABLE = {
    "qgemv": Tunable("quant-linear", {"BN_FMA": (32, 64, 128), "KT_FMA": (128, 256, 512), "WAVES": (4, 6, 8)}),
    "state_update": Tunable("state-update", {"tile": (2048, 4096, 8192), "num_warps": (4, 8),
                                             "int8/tile": (4096, 8192)}),
}


def _get(cfg: dict, path: str):
    *outer, key = path.split("/")
    for k in outer:
        cfg = cfg[k]
    return cfg[key]


def _set(cfg: dict, values: dict) -> None:
    """Set ``values`` (path -> value) into ``cfg`` in place (nested dicts stay the same objects)."""
    for path, value in values.items():
        *outer, key = path.split("/")
        node = cfg
        for k in outer:
            node = node[k]
        node[key] = value


def save(op: str, device: str, settings: dict, path: Path | None = None) -> Path:
    """Write ``settings`` as ``device``'s entry of ``op``'s config file (default: the package's), keeping the rest."""
    from ssmq.kernels import configs

    path = Path(path) if path else configs.path(op)
    data = json.loads(path.read_text()) if path.exists() else json.loads(configs.path(op).read_text())
    data["devices"][device] = settings
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def run(args) -> dict:
    from ssmq.bench.models import device_and_dtype
    from ssmq.kernels import configs

    device, dtype = device_and_dtype(args.device, args.dtype)
    if device.type != "cuda":
        raise SSMQError(f"--tune times launch settings on a CUDA GPU; the device here is {device}")
    tunable = TUNABLE[args.tune]
    cfg = importlib.import_module(f"ssmq.kernels.{args.tune}").CFG
    cases = KERNEL_BENCHES[tunable.bench].fn(KernelContext(device, dtype, shape_config(args.shape), tuple(args.rows)))
    before = {p: copy.deepcopy(_get(cfg, p)) for p in tunable.grid}
    result = record("tune", device, op=args.tune, shape=args.shape, dtype=str(dtype).removeprefix("torch."),
                    warmup=args.warmup, reps=args.reps)
    for values in itertools.product(*tunable.grid.values()):
        candidate = dict(zip(tunable.grid, values))
        _set(cfg, candidate)
        try:
            ms = sum(time_fn(c.fns["ssmq"], device, args.warmup, args.reps, l2_flush=True).median_ms for c in cases)
            row = {**candidate, "us": ms * 1e3}
        except Exception as e:  # a candidate that cannot launch (resources) is reported and skipped
            row = {**candidate, "us": math.inf, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
        finally:
            _set(cfg, before)
        result["rows"].append(row)
    best = min(result["rows"], key=lambda r: r["us"])
    if not math.isfinite(best["us"]):
        raise SSMQError(f"no candidate of {args.tune} ran on {configs.device_name()}")
    settings = copy.deepcopy(cfg)
    _set(settings, {p: best[p] for p in tunable.grid})
    print(table(result["rows"], [*tunable.grid, "us", "error"]))
    name = configs.device_name()
    print(f"fastest: {', '.join(f'{p}={best[p]}' for p in tunable.grid)}; wrote {name!r} into "
          f"{save(args.tune, name, settings, args.config)}")
    for path in write(result, args.out):
        print(f"wrote {path}")
    return result
