"""The fast KV decode kernel's loop in SASS, built for sm_90 on this machine (no GPU): registers, spills and the
instructions a thread issues a 32-token tile, by opcode, for the float16 path and the quantized formats of
``bench_kvquant.py``'s layer (32 query / 8 KV heads × 128, full RoPE, sink 1), with the per-channel scales folded
or not (``CFG["FOLD"]``) and with the launches' register caps or none; and the warp kernel (``kv_decode_warp``,
whose loop is a 16-token tile of one warp), also at head dim 64 (SmolLM2's 9 / 3 heads, full RoPE; the hybrid's
6 / 2, RoPE on 32: two kv heads a program) and with Bamba-9B's RoPE on 64 of 128 channels. Strides are taken as
multiples of 16, as the launcher's specialization finds them at that shape, but for the warp kernel's codes' strides,
which it passes in 8- or 16-byte units (``kv_decode_warp.compile_signature``).
Registers come from this machine's Triton (the GPU machine's may differ by a few: ``bench_kvquant.py`` runs record
theirs).

    python tests/sass_kv_decode.py [--out kvquant_sass.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ssmq.kernels import kv_decode_fast as kf
from ssmq.kernels.build import compile_sm90, main_loop, registers

E, GROUP = 128, 4
STRIDES = ("s_qb", "s_qh", "k_s", "k_t", "k_h", "k_ms", "k_mt", "k_os", "k_ot", "v_s", "v_t", "v_h", "v_ms", "v_mt",
           "v_os", "v_ot", "ks_s", "ks_t", "ks_h", "vs_s", "vs_t", "vs_h", "s_ob", "s_oh", "w_b", "w_p", "w_e", "c_b",
           "c_k", "s_tab")
SHOWN = ("HMMA", "PRMT", "HFMA2", "FFMA", "FMUL", "HADD2", "F2FP", "IMAD", "MOV", "LDG", "LDGSTS", "LDS", "STS", "BAR")


def build(bits: int | None, fold: bool, cap: int | None, slots: int = 0):
    """Compile one variant (bits None: the float16 path)."""
    if bits is None:
        flags = dict(FLOAT=True, K_PER_TOKEN=False, V_PER_TOKEN=False, KSLOTS=0, VSLOTS=0, KBITS=8, VBITS=8,
                     KLEVELS=1, VLEVELS=1)
        rotary, sink, pointers = 0, 0, kf.pointer_types("fp16")
    else:
        flags = dict(FLOAT=False, K_PER_TOKEN=False, V_PER_TOKEN=True, KSLOTS=2 * slots, VSLOTS=slots, KBITS=bits,
                     VBITS=bits, KLEVELS=2 ** bits, VLEVELS=2 ** bits)
        rotary, sink, pointers = E, 1, kf.pointer_types()
    const = dict(kf.constexprs(GROUP, E, rotary, sink, flags, kf.CFG["BLOCK_T"], False), FOLD=fold, BS=0)
    return compile_sm90(kf._decode_kernel, pointers, const, floats=("scale",), num_warps=kf.CFG["num_warps"],
                        num_stages=kf.CFG["num_stages"], aligned=(*pointers, *STRIDES), maxnreg=cap)


def build_warp(bits: int = 4, sink: int = 1, slots: bool = False, e: int = E, rotary: int = E,
               group: int = GROUP):
    """``kv_decode_warp``'s kernel as launched on the bench's layer (one warp, Gluon), or at head dim 64."""
    from ssmq.kernels import kv_decode_warp as kw

    pointers, strides, unit = kw.compile_signature(e)
    const = dict(kw.constexprs(group, e, rotary, sink, 0, False, slots, slots, bits, bits, unit), w_h=1)
    return compile_sm90(kw._decode_kernel, pointers, const, floats=("scale",), num_warps=1,
                        aligned=(*pointers, *strides))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ten = round(0.01 * 8 * E)  # value slots of 1% (keys: twice), as bench_kvquant's ONE_PCT
    variants = [("float16", None, False, None, 0)]
    variants += [(f"{bits}-bit{', folded' if fold else ''}{f', cap {cap}' if cap else ''}", bits, fold, cap, 0)
                 for bits in (4, 3, 2) for fold, cap in ((False, None), (True, None), (True, kf.CFG["MAXNREG"]))]
    variants += [(f"4-bit + 1%{', folded' if fold else ''}{f', cap {cap}' if cap else ''}", 4, fold, cap, ten)
                 for fold, cap in ((False, None), (True, None), (True, kf.CFG["MAXNREG_OUTLIERS"]))]
    # the warp kernel (kv_decode_warp): its loop is a 16-token tile of one warp, not a 32-token tile of 4 warps
    variants += [(f"{bits}-bit{' + 1%' if slots else ''}, warp kernel", ("warp", bits), False, None, slots)
                 for bits in (4, 3, 2) for slots in (0, ten)]
    variants += [(f"{bits}-bit, warp, {name}", ("warp", bits, e, rotary, group), False, None, 0)
                 for name, e, rotary, group in (("SmolLM2", 64, 64, 3), ("hybrid", 64, 32, 3), ("Bamba-9B", E, 64, 4))
                 for bits in (4, 3, 2)]
    rows = []
    print(f"{'variant':28s} {'regs':>4s} {'stack':>5s} {'loop':>5s}  " + " ".join(f"{op:>5s}" for op in SHOWN))
    for name, bits, fold, cap, slots in variants:
        warp = isinstance(bits, tuple)
        compiled = build_warp(bits[1], 1, bool(slots), *bits[2:]) if warp else build(bits, fold, cap, slots)
        regs, stack = registers(compiled)
        ops = main_loop(compiled)
        rows.append({"variant": name, "registers": regs, "stack_bytes": stack, "loop_instructions": sum(ops.values()),
                     "opcodes": dict(ops.most_common())})
        print(f"{name:28s} {regs:4d} {stack:5d} {sum(ops.values()):5d}  " + " ".join(f"{ops[op]:5d}" for op in SHOWN),
              flush=True)
    if args.out:
        import triton

        Path(args.out).write_text(json.dumps({"triton": triton.__version__, "target": "sm_90", "rows": rows},
                                             indent=2))


if __name__ == "__main__":
    main()
