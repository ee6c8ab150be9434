"""Loaders for ``ProcessEngine`` in the tests: module-level functions (they pickle by name) that build a model in
the engine process, with faults injected there on request.

Injected by the sampling seed of a request (sampled rows only): seed 666 makes the sampler raise from the 4th
token of that row on (a fault of one request); seed 999 ends the engine process at once, exit code 7 (a crash
of the whole engine, as a kernel fault would be).
"""

from __future__ import annotations

import os
import time

FAULT_SEED, CRASH_SEED = 666, 999


def tiny(cfg, arch: str = "mamba2", seed: int = 3, step_sleep: float = 0.0, faults: bool = False):
    """The tiny model of ``arch`` (tests/tiny_ssm.py); ``step_sleep``: each decode step takes at least that many
    seconds; ``faults``: the seeds above inject their faults."""
    import torch

    from tiny_ssm import tiny_model
    from ssmq.runtime.engine import LocalRunner

    torch.set_num_threads(1)
    model = tiny_model(arch, seed=seed)
    if faults:
        _inject_faults()
    if not step_sleep:
        return model
    runner = LocalRunner(model, cfg)
    decode = runner.decode

    def slow(tokens, slots):
        time.sleep(step_sleep)
        return decode(tokens, slots)

    runner.decode = slow
    return model, runner


def trained(cfg, name: str = "mamba2"):
    """A trained reference model of ../shared/models."""
    import torch

    from ssmq.paths import shared_path
    from ssmq.quant import load_model

    torch.set_num_threads(1)
    return load_model(shared_path("models", name), dtype=torch.float32, device="cpu").eval()


def failing(cfg):
    """A load that fails in the engine process, naming the kernel policy active there."""
    from ssmq.kernels.policy import active

    raise ValueError(f"no weights here ({active().describe()})\nsecond line")


def _inject_faults() -> None:
    from ssmq.runtime import sampling

    calls = {}
    sample = sampling.sample_row

    def faulty(logits, params, generator, counts):
        if params.seed == CRASH_SEED:
            os._exit(7)
        if params.seed == FAULT_SEED:
            calls[FAULT_SEED] = calls.get(FAULT_SEED, 0) + 1
            if calls[FAULT_SEED] > 3:
                raise RuntimeError("injected fault")
        return sample(logits, params, generator, counts)

    sampling.sample_row = faulty
