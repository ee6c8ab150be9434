"""The collectives of tensor parallelism: one ``Communicator`` per process group.

    all_reduce(x)      sum over ranks, returned in x's dtype. Backends (``mode``):
        "nccl"         torch.distributed.all_reduce (NCCL on CUDA, gloo on CPU); graph-capturable on NCCL
        "oneshot"      PyTorch symmetric memory: every rank copies x into a peer-mapped buffer and reads
                       all peers' buffers directly (``symm_mem.one_shot_all_reduce_out``, no multicast);
                       graph-capturable; CUDA only
        "auto"         "oneshot" for messages up to ``oneshot_max_bytes`` when symmetric memory works and
                       the dtype is one its kernels take (``ONESHOT_DTYPES``), else "nccl" (the default)
    ``payload`` quantizes what travels (beyond the paper's FP32 -> FP16):
        "bf16"         bf16 codes
        "int8"         int8 codes with one float32 scale per ``block`` values of a row (absmax / 127); the
                       fused norm's sum-of-squares column travels unquantized (``exact_cols``)
      A quantized all-reduce is an all-gather of the codes followed by a sum in float32, in rank order,
      on every rank: all ranks get bit-identical results (a requirement: the residual stream is replicated).
    all_reduce_max(x)  elementwise max (dynamic activation scales of row-parallel quantized linears)
    all_gather(x)      concatenation along the last dim, in rank order (online Hadamard inputs)

Every call is also counted per name (``counts``) while ``counting`` is on, to report collectives per token.
"""

from __future__ import annotations

import os
from collections import Counter

import torch
import torch.distributed as dist

from ssmq.errors import SSMQError

MODES = ("auto", "nccl", "oneshot")
PAYLOADS = ("none", "bf16", "int8")
DEFAULT_ONESHOT_MAX_BYTES = 512 * 1024  # vLLM's one-shot / NCCL crossover on 2 H100 is around 0.5 MB
# PyTorch 2.11's one-shot kernels dispatch on these only ("not implemented for 'Half'" on 2 H200):
# float16 rows take NCCL
ONESHOT_DTYPES = (torch.bfloat16, torch.float32)


class Communicator:
    def __init__(self, group=None, mode: str = "auto", payload: str = "none", block: int = 128,
                 oneshot_max_bytes: int = DEFAULT_ONESHOT_MAX_BYTES, device=None):
        if mode not in MODES:
            raise SSMQError(f"unknown all-reduce mode {mode!r}; expected one of {', '.join(MODES)}")
        if payload not in PAYLOADS:
            raise SSMQError(f"unknown all-reduce payload {payload!r}; expected one of {', '.join(PAYLOADS)}")
        self.group = group or dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.mode, self.payload, self.block = mode, payload, block
        self.oneshot_max_bytes = oneshot_max_bytes
        self.counting, self.counts = False, Counter()
        self._symm = None  # (buffer, group name, copy_in) once symmetric memory is set up
        if mode in ("auto", "oneshot") and device is not None and torch.device(device).type == "cuda":
            self._symm = _symmetric_buffer(self.group, oneshot_max_bytes, torch.device(device), strict=mode == "oneshot")
        if mode == "oneshot" and self._symm is None:
            raise SSMQError("the one-shot all-reduce needs CUDA and PyTorch symmetric memory")

    def _count(self, name: str) -> None:
        if self.counting:
            self.counts[name] += 1

    # -- sum ------------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, name: str = "all_reduce", exact_cols: int = 0) -> torch.Tensor:
        """x: any shape, the same on every rank -> the sum over ranks (a new tensor or x itself).

        exact_cols: trailing columns never quantized by a quantized payload (the fused norm's sum of squares,
        whose magnitude would flatten the int8 scale of the values beside it).
        """
        self._count(name)
        if self.world == 1:
            return x
        if self.payload != "none":
            if exact_cols:
                head = self._quantized_all_reduce(x[..., :-exact_cols])
                tail = sum(p.float() for p in self._gather_flat(x[..., -exact_cols:].float()))
                return torch.cat([head, tail.to(x.dtype)], dim=-1)
            return self._quantized_all_reduce(x)
        nbytes = x.numel() * x.element_size()
        if self._symm is not None and nbytes <= self.oneshot_max_bytes and x.is_cuda and x.dtype in ONESHOT_DTYPES:
            return self._oneshot(x)
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def _oneshot(self, x: torch.Tensor) -> torch.Tensor:
        buf, name, copy_in = self._symm
        x = x.contiguous()
        view = buf.view(x.dtype)[:x.numel()]
        out = torch.empty_like(x)
        if copy_in:  # the kernel copies x into the symmetric buffer itself: no memcpy of its own
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(view, x.view(-1), "sum", name, out.view(-1))
        else:
            view.copy_(x.view(-1))
            torch.ops.symm_mem.one_shot_all_reduce_out(view, "sum", name, out.view(-1))
        return out

    def _quantized_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Blocks run along the last dim of each row (one token's vector), never across tokens."""
        rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
        if self.payload == "bf16":
            total = sum(p.float() for p in self._gather_flat(rows.to(torch.bfloat16)))
        else:
            codes, scales = quantize_blocks(rows, self.block)
            cs, ss = self._gather_flat(codes), self._gather_flat(scales)
            total = sum(dequantize_blocks(c, s, rows.shape[-1], self.block) for c, s in zip(cs, ss))
        return total.to(x.dtype).reshape(x.shape)

    def _gather_flat(self, t: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return parts

    # -- other collectives ------------------------------------------------------------------------
    def all_reduce_max(self, x: torch.Tensor, name: str = "all_reduce_max") -> torch.Tensor:
        self._count(name)
        if self.world == 1:
            return x
        x = x.contiguous().clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, name: str = "all_gather") -> torch.Tensor:
        """x: (..., k) -> (..., world · k), rank order along the last dim."""
        self._count(name)
        if self.world == 1:
            return x
        return torch.cat(self._gather_flat(x), dim=-1)


def quantize_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (m, k) float -> int8 codes (m, ceil(k / block) · block), float32 scales (m, ceil(k / block));
    one absmax / 127 scale per ``block`` consecutive values of a row."""
    m, k = x.shape
    xb = torch.nn.functional.pad(x.float(), (0, (-k) % block)).reshape(m, -1, block)
    scale = (xb.abs().amax(-1) / 127.0).clamp(min=1e-12)
    codes = torch.round(xb / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return codes.reshape(m, -1), scale


def dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor, k: int, block: int) -> torch.Tensor:
    """-> (m, k) float32."""
    m = codes.shape[0]
    return (codes.reshape(m, -1, block).float() * scale[..., None]).reshape(m, -1)[:, :k]


def _symmetric_buffer(group, nbytes: int, device: torch.device, strict: bool):
    """(uint8 symmetric buffer of ``nbytes``, group name, whether ``one_shot_all_reduce_copy_out`` works), or None
    where symmetric memory is unavailable.

    NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set when absent); the one-shot
    kernel only reads peers' buffers over peer-to-peer mappings.
    """
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
            raise RuntimeError("torch.ops.symm_mem.one_shot_all_reduce_out is missing")
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, a no-op on newer
            symm_mem.enable_symm_mem_for_group(group.group_name)
        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(buf, group.group_name)
        return buf, group.group_name, _copy_in_works(buf, group)
    except Exception as e:  # noqa: BLE001 - any failure means: fall back to NCCL
        if strict:
            raise SSMQError(f"symmetric memory unavailable for the one-shot all-reduce: {e}") from e
        return None


def _copy_in_works(buf: torch.Tensor, group) -> bool:
    """Whether this torch's ``one_shot_all_reduce_copy_out`` (the input copied into the symmetric buffer inside the
    all-reduce kernel, one launch less than copy + ``one_shot_all_reduce_out``) exists and sums correctly: tried once
    at setup, on every rank (each rank sends rank + 1)."""
    op = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)
    if op is None:
        return False
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    try:
        x = torch.full((16,), float(rank + 1), device=buf.device)
        out = torch.empty_like(x)
        op(buf.view(torch.float32)[:16], x, "sum", group.group_name, out)
        ok = bool((out == world * (world + 1) / 2).all())
    except Exception:  # noqa: BLE001 - any failure: copy, then the plain one-shot kernel
        ok = False
    flag = torch.tensor([int(ok)], device=buf.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)  # every rank takes the same path
    return bool(flag.item())
