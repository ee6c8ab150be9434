"""Shared pytest setup: the tests folder on sys.path (helpers such as hf_tiny), and
tests marked ``gpu`` skipped without CUDA.

SSMQ_TRITON_INTERPRET=1 runs the gpu tests anyway, on CPU tensors through
Triton's interpreter (slow; for debugging kernels without a GPU).
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() or os.environ.get("SSMQ_TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (or SSMQ_TRITON_INTERPRET=1)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def shared_or_skip(*parts: str):
    """Path under ../shared, or skip the test with the reason when it is absent."""
    from ssmq.paths import shared_path

    p = shared_path(*parts)
    if p is None:
        pytest.skip(f"../shared/{'/'.join(parts)} is absent (shared data not mounted beside the checkout)")
    return p
