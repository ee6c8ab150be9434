"""Float32 views of small SSM parameters (A = -exp(A_log), D, dt_bias), computed once, not per decode step.

Each decode step would otherwise launch several tiny kernels per layer just to convert
these vectors; under a CUDA graph those launches are most of the step's overhead.
The cache is keyed on the parameter's storage and version, so in-place edits and
replacement (loading, quantization transforms, ``.to()``) invalidate it. A model loaded under
``torch.inference_mode()`` holds inference tensors, which have no version counter: there only
replacement invalidates (an in-place edit of an inference tensor is not seen).
"""

from __future__ import annotations

import torch
import torch.nn as nn


class FloatParamCache:
    def __init__(self):
        self._cache: dict[str, tuple[tuple, torch.Tensor]] = {}

    def get(self, module: nn.Module, name: str) -> torch.Tensor:
        p = getattr(module, name)
        key = (id(p), p.data_ptr(), None if p.is_inference() else p._version, p.dtype, p.device)
        hit = self._cache.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        with torch.no_grad():
            value = -torch.exp(p.float()) if name == "A_log" else p.float()
        self._cache[name] = (key, value)
        return value
