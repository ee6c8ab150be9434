"""The PTX byte-permute lookups of the fast KV decode kernel (``_LUT4`` / ``_LUT3`` / ``_LUT2`` in
``ssmq.kernels.kv_decode_fast``) on CPU: Triton's interpreter runs no inline PTX (it takes the gathered-LUT path), so
these blocks are executed here by a small interpreter of the few instructions they use, and their outputs compared
with the codebook entries of the codes, for random codes and codebooks (the layouts of ``pack_codes``)."""

from __future__ import annotations

import random
import struct

import pytest

M32 = 0xFFFFFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    """prmt.b32 default mode: byte k of the result is byte (sel nibble k & 7) of b:a; nibble bit 3 replicates the
    picked byte's sign bit."""
    src = [(a >> 8 * i) & 255 for i in range(4)] + [(b >> 8 * i) & 255 for i in range(4)]
    out = 0
    for k in range(4):
        n = (sel >> 4 * k) & 15
        byte = src[n & 7]
        out |= ((255 if byte & 128 else 0) if n & 8 else byte) << 8 * k
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    return sum(((lut >> (((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | (c >> i) & 1)) & 1) << i for i in range(32))


OPS = {"shr.u32": lambda a, b: a >> b, "shl.b32": lambda a, b: (a << b) & M32, "and.b32": lambda a, b: a & b,
       "or.b32": lambda a, b: a | b, "lop3.b32": _lop3, "prmt.b32": _prmt,
       "mad.lo.u32": lambda a, b, c: (a * b + c) & M32}


def run_ptx(asm: str, operands: dict[str, int]) -> dict[str, int]:
    regs = dict(operands)
    for line in asm.replace("{", "").replace("}", "").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *args = (x.strip() for x in rest.split(","))
        regs[dst] = OPS[op](*(regs[x] if x in regs else int(x, 0) for x in args))
    return regs


def _half_bits(x: float) -> int:
    return struct.unpack("<H", struct.pack("<e", x))[0]


def _tables(book: list[int]) -> tuple[list[int], list[int]]:
    """Words of entries 4k .. 4k + 3's low bytes, then their high bytes (``_lut_words`` for 3 and 4 bits)."""
    book = book + [0] * (16 - len(book))
    lo = [sum((book[4 * k + i] & 255) << 8 * i for i in range(4)) for k in range(4)]
    hi = [sum((book[4 * k + i] >> 8) << 8 * i for i in range(4)) for k in range(4)]
    return lo, hi


def _book(levels: int, rng: random.Random) -> list[int]:
    return [_half_bits(v) for v in sorted(rng.uniform(-1, 1) for _ in range(levels))]


def _halves(regs: dict[str, int], names: list[str]) -> list[int]:
    return [(regs[n] >> 16 * k) & 0xFFFF for n in names for k in range(2)]


@pytest.fixture(scope="module")
def kf():
    pytest.importorskip("triton")
    from ssmq.kernels import kv_decode_fast

    return kv_decode_fast


def test_lut4_looks_up_both_nibbles_of_each_byte(kf):
    rng = random.Random(0)
    for _ in range(300):
        book = _book(16, rng)
        lo, hi = _tables(book)
        codes = [rng.randrange(16) for _ in range(8)]  # byte k: channels 2k (low nibble), 2k + 1
        word = sum((codes[2 * k] | codes[2 * k + 1] << 4) << 8 * k for k in range(4))
        ops = {"$4": word, **{f"${5 + 4 * j + r}": w for j, w in enumerate(lo + hi) for r in range(4)}}
        regs = run_ptx(kf._LUT4.value, ops)
        assert _halves(regs, ["$0", "$1"]) == [book[codes[2 * k]] for k in range(4)]
        assert _halves(regs, ["$2", "$3"]) == [book[codes[2 * k + 1]] for k in range(4)]


def test_lut2_looks_up_the_four_codes_of_each_byte(kf):
    rng = random.Random(1)
    for _ in range(300):
        book = _book(4, rng)
        pairs = [book[0] | book[1] << 16, book[2] | book[3] << 16]  # entries (0, 1), (2, 3) as float16 pairs
        codes = [[rng.randrange(4) for _ in range(4)] for _ in range(4)]  # codes[k][i]: byte k, bits 2i
        word = sum(sum(c << 2 * i for i, c in enumerate(codes[k])) << 8 * k for k in range(4))
        ops = {"$8": word, **{f"${9 + 4 * j + r}": w for j, w in enumerate(pairs + [0] * 6) for r in range(4)}}
        regs = run_ptx(kf._LUT2.value, ops)
        for i in range(4):
            assert _halves(regs, [f"${2 * i}", f"${2 * i + 1}"]) == [book[codes[k][i]] for k in range(4)]


def test_lut3_combines_the_two_bit_planes(kf):
    """4 bytes of the 2-bit plane (code i of byte k at bits 2i) and each byte's 4 high bits (bit i: code i's bit 2)
    → the codebook entries of the 16 3-bit codes."""
    rng = random.Random(2)
    for _ in range(300):
        book = _book(8, rng)
        lo, hi = _tables(book)
        codes = [[rng.randrange(8) for _ in range(4)] for _ in range(4)]
        low = sum(sum((c & 3) << 2 * i for i, c in enumerate(codes[k])) << 8 * k for k in range(4))
        high = sum(sum((c >> 2) << i for i, c in enumerate(codes[k])) << 8 * k for k in range(4))
        ops = {"$8": low, "$9": high, **{f"${10 + 4 * j + r}": w for j, w in enumerate([lo[0], lo[1], hi[0], hi[1]])
                                          for r in range(4)}}
        regs = run_ptx(kf._LUT3.value, ops)
        for i in range(4):
            assert _halves(regs, [f"${2 * i}", f"${2 * i + 1}"]) == [book[codes[k][i]] for k in range(4)]
