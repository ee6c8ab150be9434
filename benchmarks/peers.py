"""The benchmark peer: ``mamba_ssm``'s Triton ops, when the package travels (``../shared/peers/``'s tarball)."""

from __future__ import annotations

import importlib


def mamba_ssm_op(module: str, name: str):
    """``mamba_ssm.<module>.<name>``, or None (with one line saying why) when it cannot be imported."""
    try:
        return getattr(importlib.import_module(f"mamba_ssm.{module}"), name)
    except Exception as e:  # noqa: BLE001 - any import failure just drops the peer column
        print(f"mamba_ssm not available ({type(e).__name__}: {e}); its column stays blank")
        return None
