"""What the GEMMs and GEMVs on stored weight codes share (``quant_gemm``, ``qgemv``, ``packed_gemv``, ``qgemm_mid``,
``qgemm_a8``, ``moe``): codes to exact floats by bit assembly (int8 to fp16; a 32-bit word's int4 / int8 / e4m3
codes to float32 for the word GEMVs), the scale / zero-point / bias epilogue, the tile set-up, products and output
offsets of a program over an output tile and a k range, and the K split summed inside the kernel with its
self-resetting counters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _i8_to_f16(q):
    """int8 codes -> the same integers in fp16, exactly, by bit assembly on four codes a register: a half 0x64XX
    is 1024 + XX, so (code ^ 0x80) placed in a half's low byte reads 1152 + code, and one packed subtraction
    removes the 1152. Integer and half2 ops only: the I2F conversion it replaces issues at 16 a clock per SM
    on Hopper and bounded the decode GEMV (configs/quant_gemm.json). Not in the interpreter (no PTX there)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, m, c;
        mov.b32 m, 0x64646464;
        mov.b32 c, 0x64806480;
        xor.b32 t, $2, 0x80808080;
        prmt.b32 $0, t, m, 0x5140;
        prmt.b32 $1, t, m, 0x5342;
        sub.f16x2 $0, $0, c;
        sub.f16x2 $1, $1, c;
        }""",
        constraints="=r,=r,r", args=[q], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _code_halves(w, W4: tl.constexpr):
    """Each 32-bit word of codes w as two words (its low / high 16 bits) ready for _code_f32: every code's sign bit
    flipped (two's complement -> offset binary, q + 2^(b-1)) and the exponent of 2^23 above them. One LOP3 for the
    low half, a shift and one LOP3 for the high one, shared by the word's 8 (int4) or 4 (int8) codes."""
    C: tl.constexpr = 0x4B000000 | (0x8888 if W4 else 0x8080)
    return (w & 0xFFFF) ^ C, ((w >> 16) & 0xFFFF) ^ C


@triton.jit
def _code_f32(lo, hi, J: tl.constexpr, W4: tl.constexpr):
    """Code J of each word (lo, hi from _code_halves) as an exact float32 times 2^P (P: its bit offset within
    its half), by bit assembly: no I2F, the quarter-rate conversion that bounded the old decode loop. Masking the
    half to the exponent and the code gives 2^23 + (q + 2^(b-1)) 2^P (one LOP3, its one constant an immediate);
    one FADD removes 2^23 + 2^(b-1) 2^P exactly. The caller scales the matching x by 2^-P (exact)."""
    BITS: tl.constexpr = 4 if W4 else 8
    H: tl.constexpr = 16 // BITS  # codes per half word
    P: tl.constexpr = BITS * (J % H)
    MASK: tl.constexpr = 0x7F800000 | (((1 << BITS) - 1) << P)
    OFF: tl.constexpr = (1 << 23) + ((1 << (BITS - 1)) << P)
    src = hi if J >= H else lo
    return (src & MASK).to(tl.float32, bitcast=True) - OFF


@triton.jit
def _fp8_f32(w, J: tl.constexpr):
    """Byte J of each 32-bit word of e4m3 codes as its exact float32 value (the hardware e4m3 -> f16 conversion,
    two codes an instruction; no scale: the epilogue applies it)."""
    return ((w >> (8 * J)) & 0xFF).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _x_f32(xv, HI: tl.constexpr, X16: tl.constexpr, XBF16: tl.constexpr):
    """float32 x from a load: 16-bit x travels as int32 pairs (HI: the odd column), one load for two columns."""
    if X16:
        if XBF16:
            r = ((xv & -65536) if HI else (xv << 16)).to(tl.float32, bitcast=True)
        else:
            r = ((xv >> 16) if HI else xv).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        r = xv.to(tl.float32)
    return r


@triton.jit
def _rows_tile(t0, t1, t2, t3, offs_m):
    """(BLOCK_M, BLOCK_N) from the rows' (BLOCK_N,) vectors (BLOCK_M <= 4; t1.. unused past BLOCK_M)."""
    tile = tl.where(offs_m[:, None] == 0, t0[None, :], 0)
    tile = tl.where(offs_m[:, None] == 1, t1[None, :], tile)
    tile = tl.where(offs_m[:, None] == 2, t2[None, :], tile)
    return tl.where(offs_m[:, None] == 3, t3[None, :], tile)


@triton.jit
def _scale_bias_store(acc, xs, xsum, ws_ptr, wz_ptr, b_ptr, out_ptr, offs_n, mn, rows, mm, pid_k, s_om, s_os,
                      SCALE: tl.constexpr, A_MODE: tl.constexpr, WS_MODE: tl.constexpr, HAS_ZERO: tl.constexpr,
                      HAS_BIAS: tl.constexpr):
    """The end of ``quant_gemm``'s ``_qmm`` and ``_qgemv`` (and of the word GEMVs, ``_finish_words``): acc
    (BLOCK_M, BLOCK_N) float32 times the per-channel / per-tensor scales (SCALE; per-group scales were applied inside
    the K loop), minus zero · Σx (xsum (BLOCK_M,)) for asymmetric weight-only formats, plus bias, stored at split
    pid_k of out."""
    if SCALE:
        if WS_MODE == 1:
            s = tl.load(ws_ptr + offs_n, mask=mn, other=0.0)
        else:
            s = tl.load(ws_ptr + offs_n * 0)
        if A_MODE != 0:
            acc = acc * (xs[:, None] * s[None, :])
        else:
            if HAS_ZERO:
                z = tl.load(wz_ptr + (offs_n if WS_MODE == 1 else offs_n * 0), mask=mn, other=0).to(tl.float32)
                acc -= z[None, :] * xsum[:, None]
            acc = acc * s[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + pid_k * s_os + rows[:, None] * s_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


@triton.jit
def _finish_words(tot, xs, ws_ptr, wz_ptr, b_ptr, out_ptr, offs_n, mn, rows, mm, s_om,
                  A_MODE: tl.constexpr, WS_MODE: tl.constexpr, HAS_BIAS: tl.constexpr):
    # zero points are already applied (per split): _scale_bias_store's scale epilogue, into out
    _scale_bias_store(tot.to(tl.float32), xs, xs * 0.0, ws_ptr, wz_ptr, b_ptr, out_ptr, offs_n, mn, rows, mm, 0,
                      s_om, 0, WS_MODE != 2, A_MODE, WS_MODE, False, HAS_BIAS)


@triton.jit
def _code_tiles(x_ptr, w_ptr, ws_ptr, M, N, K, k_split, n_groups, s_xm, s_wn, W4: tl.constexpr,
                X_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Where program (tile, pid_k) of a GEMM on stored weight codes (qgemm_mid, qgemm_a8) works: output rows
    [pid_m BM, +BM) x columns [pid_n BN, +BN) over k in [pid_k k_split, +k_split). The row tiles of one column tile
    are neighbours in launch order, so they read its weight tile while it is in L2. Returns tile, pid_k, offs_m
    (BM,), offs_n (BN,), their masks mm, mn, rows / cols (int64 offs_m / offs_n), k_len (k this program covers), and
    the first step's pointers: w_ptrs (BN, BK, or BK / 2 int4 bytes), x_ptrs (BM, BK; X_SPLIT 1 with int4: the even
    columns' BK / 2), s_ptrs (BN,) the group scales."""
    m_blocks = tl.cdiv(M, BLOCK_M)
    tile = tl.program_id(0)
    pid_m, pid_n, pid_k = tile % m_blocks, tile // m_blocks, tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, mn = offs_m < M, offs_n < N
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    WK: tl.constexpr = BLOCK_K // 2 if W4 else BLOCK_K  # code bytes a weight row a step
    offs_kw = tl.arange(0, WK)
    k0 = pid_k * k_split
    k_len = tl.minimum(k_split, K - k0)
    w_ptrs = w_ptr + cols[:, None] * s_wn + ((k0 // 2) if W4 else k0) + offs_kw[None, :]
    if W4 and X_SPLIT == 1:
        x_ptrs = x_ptr + rows[:, None] * s_xm + k0 + 2 * offs_kw[None, :]
    else:
        x_ptrs = x_ptr + rows[:, None] * s_xm + k0 + tl.arange(0, BLOCK_K)[None, :]
    s_ptrs = ws_ptr + cols * n_groups + k0 // BLOCK_K
    return tile, pid_k, offs_m, offs_n, mm, mn, rows, cols, k_len, w_ptrs, x_ptrs, s_ptrs


@triton.jit
def _w_dot(w, xv, acc, SWAP: tl.constexpr, OUT: tl.constexpr, PRECISION: tl.constexpr = None):
    """acc + the product of a weight tile w (BN, k) and an x tile xv (BM, k): (BN, BM) = W @ x.T with SWAP (the
    weight tile the tensor-core instruction's M side), else (BM, BN) = x @ W.T; accumulated in OUT, float32 operands
    multiplied at PRECISION (tl.dot's input_precision; None: its default)."""
    if SWAP:
        r = tl.dot(w, tl.trans(xv), acc, out_dtype=OUT, input_precision=PRECISION)
    else:
        r = tl.dot(xv, tl.trans(w), acc, out_dtype=OUT, input_precision=PRECISION)
    return r


@triton.jit
def _w4_dot(lo, hi, x_ptrs, mm, acc, SWAP: tl.constexpr, X_SPLIT: tl.constexpr, OUT: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + one k step of int4 codes: lo / hi (BN, BK / 2) the operands of the even / odd columns' codes (low / high
    nibbles), x read at x_ptrs (``_code_tiles``). X_SPLIT: 0 the codes interleaved back into k order, one product
    with the contiguous x tile; 1 the even / odd x columns loaded apart; 2 a contiguous x tile split in registers
    (1 and 2: two products)."""
    if X_SPLIT == 1:
        xe = tl.load(x_ptrs, mask=mm[:, None], other=0)
        xo = tl.load(x_ptrs + 1, mask=mm[:, None], other=0)
    else:
        xv = tl.load(x_ptrs, mask=mm[:, None], other=0)
    if X_SPLIT == 0:
        acc = _w_dot(tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K)), xv, acc, SWAP, OUT)
    else:
        if X_SPLIT == 2:
            xe, xo = tl.split(tl.reshape(xv, (BLOCK_M, BLOCK_K // 2, 2)))
        acc = _w_dot(lo, xe, acc, SWAP, OUT)
        acc = _w_dot(hi, xo, acc, SWAP, OUT)
    return acc


@triton.jit
def _out_offsets(offs_m, offs_n, rows, cols, mm, mn, N, s_om, SWAP: tl.constexpr):
    """An output tile's offsets in the split partials (rows of N) and in out (rows of s_om), its mask, and the
    index vector along the accumulator's first axis (``_split_gather``'s offs_m): (BN, BM) with SWAP, else (BM, BN)."""
    if SWAP:
        p_off = cols[:, None] + rows[None, :] * N
        o_off = cols[:, None] + rows[None, :] * s_om
        mo = mn[:, None] & mm[None, :]
        first = offs_n
    else:
        p_off = rows[:, None] * N + cols[None, :]
        o_off = rows[:, None] * s_om + cols[None, :]
        mo = mm[:, None] & mn[None, :]
        first = offs_m
    return p_off, o_off, mo, first


@triton.jit
def _split_gather(part_ptr, cnt_ptr, tile, n_split, MN, p_off, mo, offs_m, NSP: tl.constexpr):
    """A K split summed inside the kernel, once this program stored its partial at part_ptr + pid_k * MN + p_off
    (p_off: (BLOCK_M, BLOCK_N) offsets of its output tile, mo their mask). It counts itself at cnt_ptr[tile]
    (acq_rel, after a barrier: every thread's partial is stored before the count releases it); the last of the
    tile's n_split programs reads the partials back (one load for all NSP >= n_split of them: a loop of loads
    measured one L2 round trip per split, ~0.5 us each, on the H100) and adds them in a fixed order
    (deterministic, whichever program came last), and zeroes the count for the next launch, so CUDA-graph replays
    need no reset and no second kernel runs. Returns the sum and a (BLOCK_M,) mask true only in that last
    program (elsewhere nothing is read)."""
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
    last = (offs_m * 0 + done) == n_split - 1
    offs_s = tl.arange(0, NSP)
    ml = (offs_s < n_split)[:, None, None] & (mo & last[:, None])[None, :, :]
    parts = tl.load(part_ptr + offs_s[:, None, None] * MN + p_off[None, :, :], mask=ml, other=0,
                    cache_modifier=".cg")
    tl.store(cnt_ptr + tile + offs_m * 0, offs_m * 0, mask=last)
    return tl.sum(parts, axis=0), last


_COUNTS: dict = {}  # (device, stream) -> int32 tile counts of the split decode GEMV, zero between launches


def _counts(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters for ``tiles`` output tiles, one buffer per (device, stream): each launch leaves them
    zero again, so kernels in one stream (and CUDA-graph replays) share it; allocated before any capture by the
    first eager call (a call that must grow it during a capture zeroes it inside the graph, still correct)."""
    key = (str(device), torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    buf = _COUNTS.get(key)
    if buf is None or buf.numel() < tiles:
        buf = _COUNTS[key] = torch.zeros(max(tiles, 1 << 14), device=device, dtype=torch.int32)
    return buf


def split_buffers(split: int, M: int, N: int, tiles: int, device: torch.device, dtype: torch.dtype,
                  out: torch.Tensor, depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial sums (depth, M, N) of ``dtype``, the ``tiles`` output tiles' counters) of a kernel whose K is split
    ``split`` ways and whose last program of a tile adds them (``_split_gather``); ``depth`` is ``split`` unless the
    kernel keeps one slice per quantization group; (out, out) placeholders when ``split`` is 1."""
    if split == 1:
        return out, out
    return torch.empty((depth or split, M, N), device=device, dtype=dtype), _counts(device, tiles)
