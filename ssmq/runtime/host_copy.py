"""Device tensors read back without waiting for the work queued after them.

Reading a CUDA tensor (``.tolist()``) waits for the whole stream, so a read of step n's tokens would also wait for
step n + 1 when it was launched before the read; the device then idles while the host turns to launch step n + 2.
``HostCopy`` starts non-blocking copies into pinned memory and records an event after them, on the stream of the
tensors' device (the caller's current device may be another), so the read waits for the copies alone.
"""

from __future__ import annotations

import torch


class HostCopy:
    """Copies of ``tensors`` (all on one device) on their way to the host; ``lists()`` waits for them (CUDA) and
    returns each as a list. On other devices the tensors are read as they are."""

    def __init__(self, *tensors: torch.Tensor):
        self.tensors, self.ready = tensors, None
        if tensors and tensors[0].device.type == "cuda":
            self.tensors = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                                 for t in tensors)
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(tensors[0].device))

    def lists(self) -> list[list]:
        if self.ready is not None:
            self.ready.synchronize()
        return [t.tolist() for t in self.tensors]
