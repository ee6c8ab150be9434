"""A persistent chain of int4 decode GEMVs: in_proj -> out_proj of L layers in one launch, grid-wide barriers
between them, the next GEMV's first weight request (one tile, or an item's whole K run) made before each barrier.

A measurement of the persistent-decode design, not an executor: one row, int4 codes in groups of 128 in
``ops.quant_linear.pack_words``' layout (what ``kernels.packed_gemv`` reads), no norm, no mixer between the two
GEMVs (out_proj reads the first k of in_proj's output). It answers what the layer's two weight streams cost when
no kernel boundary separates them, against the same chain as ``packed_gemv`` launches (CUDA graph, PDL).

Work: each GEMV is cut in items of (BLOCK_N columns, ``iters`` tiles of k); program p of P runs items p, p + P, ...
An item's float32 partial goes to ``part`` and the last item of a column tile adds them in a fixed order
(``gemm_parts._split_gather``: deterministic, its counter reset for the next use). Every program must be resident
at once (the caller keeps P within ``resident_programs``; more would wait forever): a barrier waits for all of them.

Barrier (``_grid_sync``): an arrival counter and a generation; the last to arrive resets the counter and bumps the
generation (release), the others spin on the generation (acquire). Nothing to reset between launches, so CUDA graph
replays need no memset. x is read past L1 (``.cg``): another SM wrote it since this one last read that address.

Glossary: P programs, L layers, n columns, k features, CB codes a block (128 for int4), NB blocks a tile row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.kernels._common import cdiv, pow2, sm_count
from ssmq.kernels.packed_gemv import _block_scales, _slot_f32
from ssmq.kernels.gemm_parts import _split_gather

BLOCK_N = 128  # columns an item (packed_gemv's tile at 2048 words, NB 1)
NB = 1
CB = 128  # int4 codes a block of 16 words
GROUP = 128


@triton.jit
def _grid_sync(bar_ptr, P):
    """Every program of the grid arrives here before any leaves (bar_ptr[0] arrivals, bar_ptr[1] generation)."""
    tl.debug_barrier()  # the program's stores are issued before it arrives
    gen = tl.atomic_add(bar_ptr + 1, 0, sem="acquire")
    arrived = tl.atomic_add(bar_ptr, 1, sem="acq_rel")
    if arrived == P - 1:
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed")
        tl.atomic_add(bar_ptr + 1, 1, sem="release")
    else:
        g = tl.atomic_add(bar_ptr + 1, 0, sem="acquire")
        while g == gen:
            g = tl.atomic_add(bar_ptr + 1, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _item_request(w_ptr, ws_ptr, item, N, k_tiles, iters, n_split, n_groups, s_wn,
                  BLOCK_N: tl.constexpr, NB: tl.constexpr, GB: tl.constexpr, T: tl.constexpr):
    """The codes and scales of an item's first T tiles (masked off past the item, or for an item past the GEMV's)."""
    pid_n, pid_k = item // n_split, item % n_split
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = (offs_n < N) & (item < tl.cdiv(N, BLOCK_N) * n_split)
    cols = offs_n.to(tl.int64)
    t0 = pid_k * iters
    blk = t0 * NB + tl.arange(0, NB * T)
    valid = blk < (t0 + tl.minimum(iters, k_tiles - t0)) * NB
    w = tl.load(w_ptr + cols[:, None, None] * s_wn + (blk[:, None] * 16 + tl.arange(0, 16)[None, :])[None, :, :],
                mask=mn[:, None, None] & valid[None, :, None], other=0)
    s = _block_scales(ws_ptr, cols, n_groups, blk, mn, valid[None, :], GB, 2)
    return w, s


@triton.jit
def _gemv_items(x_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, cnt_ptr, N, k_tiles, iters, n_split, n_groups, s_wn,
                w_pre, s_pre, pid, P, BLOCK_N: tl.constexpr, NB: tl.constexpr, GB: tl.constexpr,
                NSP: tl.constexpr, T: tl.constexpr):
    """This program's items of out = x @ W.T (x (k,) float16, out (n,) float16), T tiles a request, the next
    request in flight while one is computed; w_pre / s_pre: its first item's first request, loaded already."""
    CB: tl.constexpr = 128
    TB: tl.constexpr = NB * T  # blocks a request
    offs_b = tl.arange(0, TB)
    offs_w = tl.arange(0, 16)
    offs_m = tl.arange(0, 1)
    w_next, s_next = w_pre, s_pre
    for item in range(pid, tl.cdiv(N, BLOCK_N) * n_split, P):
        pid_n, pid_k = item // n_split, item % n_split
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = offs_n < N
        cols = offs_n.to(tl.int64)
        t0 = pid_k * iters
        end = (t0 + tl.minimum(iters, k_tiles - t0)) * NB  # the item's blocks: [t0 * NB, end)
        blk = t0 * NB + offs_b
        w_ptrs = w_ptr + cols[:, None, None] * s_wn + (blk[:, None] * 16 + offs_w[None, :])[None, :, :]
        if item != pid:
            w_next, s_next = _item_request(w_ptr, ws_ptr, item, N, k_tiles, iters, n_split, n_groups, s_wn,
                                           BLOCK_N, NB, GB, T)
        x_ptrs = x_ptr + blk[None, :, None] * CB + offs_w[None, None, :]
        acc = tl.zeros((BLOCK_N, TB), dtype=tl.float32)
        for r in range(tl.cdiv(end - t0 * NB, TB)):
            w = w_next
            s = s_next
            valid = blk < end
            more = (blk + TB) < end
            w_next = tl.load(w_ptrs + TB * 16, mask=mn[:, None, None] & more[None, :, None], other=0)
            s_next = _block_scales(ws_ptr, cols, n_groups, blk + TB, mn, more[None, :], GB, 2)
            lo = (w & 0xFFFF) | 0x4B000000
            hi = ((w >> 16) & 0xFFFF) | 0x4B000000
            q = tl.zeros(w.shape, dtype=tl.float32)
            for j in tl.static_range(8):  # a masked block's codes read -8 and its x 0: it adds nothing
                q += tl.load(x_ptrs + j * 16, mask=valid[None, :, None], other=0.0,
                             cache_modifier=".cg").to(tl.float32) * _slot_f32(lo, hi, j, 4)
            acc += tl.sum(q, axis=2) * s
            w_ptrs += TB * 16
            x_ptrs += TB * CB
            blk += TB
        tot = tl.sum(acc, axis=1)[None, :]  # (1, BLOCK_N)
        p_off = offs_n[None, :]
        mo = mn[None, :]
        tl.store(part_ptr + pid_k * N + p_off, tot, mask=mo)
        tot, last = _split_gather(part_ptr, cnt_ptr, pid_n, n_split, N, p_off, mo, offs_m, NSP)
        tl.store(out_ptr + p_off, tot.to(tl.float16), mask=mo & last[:, None])


@triton.jit
def _chain(x_ptr, mid_ptr, bar_ptr,
           w1_ptr, s1_ptr, part1_ptr, cnt1_ptr, N1, kt1, it1, sp1, ng1, sw1, l_w1, l_s1,
           w2_ptr, s2_ptr, part2_ptr, cnt2_ptr, N2, kt2, it2, sp2, ng2, sw2, l_w2, l_s2,
           n_layers, GB: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, NSP: tl.constexpr,
           SYNC: tl.constexpr = True, T: tl.constexpr = 1):
    # per layer l: mid = x @ W1[l].T (in_proj), barrier, x = mid[:k2] @ W2[l].T (out_proj), barrier
    pid, P = tl.program_id(0), tl.num_programs(0)
    w_pre, s_pre = _item_request(w1_ptr, s1_ptr, pid, N1, kt1, it1, sp1, ng1, sw1, BLOCK_N, NB, GB, T)
    for layer in range(n_layers):
        w1 = w1_ptr + layer * l_w1
        s1 = s1_ptr + layer * l_s1
        w2 = w2_ptr + layer * l_w2
        s2 = s2_ptr + layer * l_s2
        _gemv_items(x_ptr, w1, s1, mid_ptr, part1_ptr, cnt1_ptr, N1, kt1, it1, sp1, ng1, sw1, w_pre, s_pre, pid, P,
                    BLOCK_N, NB, GB, NSP, T)
        w_pre, s_pre = _item_request(w2, s2, pid, N2, kt2, it2, sp2, ng2, sw2, BLOCK_N, NB, GB, T)
        if SYNC:
            _grid_sync(bar_ptr, P)
        _gemv_items(mid_ptr, w2, s2, x_ptr, part2_ptr, cnt2_ptr, N2, kt2, it2, sp2, ng2, sw2, w_pre, s_pre, pid, P,
                    BLOCK_N, NB, GB, NSP, T)
        nxt = tl.where(layer + 1 < n_layers, pid, 1 << 30)  # past the last layer: nothing to request
        w_pre, s_pre = _item_request(w1_ptr + (layer + 1) * l_w1, s1_ptr + (layer + 1) * l_s1, nxt, N1, kt1, it1,
                                     sp1, ng1, sw1, BLOCK_N, NB, GB, T)
        if SYNC:
            _grid_sync(bar_ptr, P)


def _split(n: int, k: int, programs: int, tiles: int) -> tuple[int, int]:
    """(iters, split) of a GEMV: about ``programs`` items, a column tile's k cut in ``split`` runs of ``iters``; with
    ``tiles`` > 1 (a request of that many tiles) runs of at most ``tiles``, so an item is one request."""
    k_tiles = k // (CB * NB)
    split = max(1, min(k_tiles, programs // cdiv(n, BLOCK_N)))
    if tiles > 1:
        split = max(split, cdiv(k_tiles, tiles))
    iters = cdiv(k_tiles, split)
    return iters, cdiv(k_tiles, iters)


class Chain:
    """Buffers and launch of ``_chain`` for L layers' in_proj (n1, k1) and out_proj (n2, k2 <= n1) words
    (L, n, k // 8) int32 and scales (L, n, k // 128); ``tiles`` a request (1: the next tile in flight while one is
    computed, as ``packed_gemv``; more: an item's tiles requested at once), ``warps`` a program."""

    def __init__(self, w1, s1, w2, s2, programs: int, tiles: int = 1, warps: int = 4):
        self.w1, self.s1, self.w2, self.s2 = w1, s1, w2, s2
        dev = w1.device
        self.L, self.n1, self.k1 = w1.shape[0], w1.shape[1], w1.shape[2] * 8
        self.n2, self.k2 = w2.shape[1], w2.shape[2] * 8
        self.P, self.tiles, self.warps = programs, tiles, warps
        self.it1, self.sp1 = _split(self.n1, self.k1, programs, tiles)
        self.it2, self.sp2 = _split(self.n2, self.k2, programs, tiles)
        self.part1 = torch.empty(self.sp1, self.n1, device=dev, dtype=torch.float32)
        self.part2 = torch.empty(self.sp2, self.n2, device=dev, dtype=torch.float32)
        self.cnt1 = torch.zeros(cdiv(self.n1, BLOCK_N), device=dev, dtype=torch.int32)
        self.cnt2 = torch.zeros(cdiv(self.n2, BLOCK_N), device=dev, dtype=torch.int32)
        self.bar = torch.zeros(2, device=dev, dtype=torch.int32)
        self.mid = torch.empty(self.n1, device=dev, dtype=torch.float16)

    def __call__(self, x: torch.Tensor, programs: int | None = None, sync: bool = True):
        """x (k1,) float16, overwritten by the last layer's out_proj output (its first n2 entries). ``sync`` off
        drops the barriers (a wrong result: the time of the two weight streams alone)."""
        P = programs or self.P
        return _chain[(P,)](
            x, self.mid, self.bar,
            self.w1, self.s1, self.part1, self.cnt1, self.n1, self.k1 // CB, self.it1, self.sp1, self.s1.shape[2],
            self.w1.stride(1), self.w1.stride(0), self.s1.stride(0),
            self.w2, self.s2, self.part2, self.cnt2, self.n2, self.k2 // CB, self.it2, self.sp2, self.s2.shape[2],
            self.w2.stride(1), self.w2.stride(0), self.s2.stride(0),
            self.L, GB=GROUP // CB, BLOCK_N=BLOCK_N, NB=NB, NSP=pow2(max(self.sp1, self.sp2)), SYNC=sync,
            T=self.tiles, num_warps=self.warps)


def resident_programs(compiled, device: torch.device, warps: int = 4) -> int:
    """How many programs of a compiled kernel of ``warps`` warps fit on the GPU at once (registers, shared memory,
    threads)."""
    props = torch.cuda.get_device_properties(device)
    threads = 32 * warps
    by_regs = props.regs_per_multiprocessor // max(1, compiled.n_regs * threads)
    smem = compiled.metadata.shared
    by_smem = props.shared_memory_per_multiprocessor // smem if smem else 64
    by_threads = props.max_threads_per_multi_processor // threads
    return min(by_regs, by_smem, by_threads, 32) * sm_count(device)
