"""Kernel launch settings as data: ``<op>.json`` beside this module, one file an op.

A file holds ``why`` (the hardware facts behind the settings) and ``devices``: the settings by the name CUDA gives a
device (``torch.cuda.get_device_name()``, e.g. "NVIDIA H100 80GB HBM3"), ``default`` for any other device and the
interpreter. Shape ranges are entries of the settings (rows a path serves, tiles by state format). A kernel module
keeps ``load(op)`` as its ``CFG`` and reads it at each launch, so tests and the tuner override entries in place;
``ssmq bench kernels --tune OP`` times candidates on the current GPU and writes its entry (docs/kernels.md).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import torch

FOLDER = Path(__file__).resolve().parent
DEFAULT = "default"


def device_name() -> str:
    """The current CUDA device's name, ``DEFAULT`` without one."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else DEFAULT


def path(op: str) -> Path:
    return FOLDER / f"{op}.json"


def entry(table: dict, device: str) -> dict:
    """A copy of ``device``'s settings in an op's table, the ``default`` ones for a device it does not name."""
    devices = table["devices"]
    return copy.deepcopy(devices.get(device, devices[DEFAULT]))


@functools.lru_cache(maxsize=None)
def load(op: str) -> dict:
    """The launch settings of ``op`` for the current device, read once (every caller shares the dict)."""
    return entry(json.loads(path(op).read_text()), device_name())
