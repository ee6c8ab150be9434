"""Where the KVQuant decode kernel's outlier time goes (one GPU): the dispatch (``kernels.quant_kv_decode``) timed on
``bench_kvquant``'s 4-bit cache and layer shape without outliers, with 1% key and value outliers, with key
outliers only and with value outliers only (CUDA-graph replays, L2 flushed: ``bench_kvquant.timeit``), each with the
registers a thread and the bytes spilled of the kernel it compiled (a spilling kernel pays for every live value);
``--kernels`` also splits each case's time among its kernels (torch.profiler, eager calls, L2 flushed before each).

    python benchmarks/time_kv_outlier_parts.py [--length 131072] [--kernels] [--key-live 0.5]
        [--cfg 'GP_MIN=16;SPARSE_SLOTS=256,SPARSE_PROGRAMS=8']
    ncu --section WarpStateStats --section SourceCounters -k regex:_decode_kernel -s 2 -c 1 \
        python benchmarks/time_kv_outlier_parts.py --profile [--case 0-4]   (3 plain calls of one case, for ncu)
"""

from __future__ import annotations

import argparse

import torch

import bench_kvquant as b
from ssmq.kernels import kv_decode_fast, quant_kv_decode


def _compiled() -> dict:
    """The fast decode kernel's compiled variants so far, by id (Triton keeps them per device)."""
    found = {}
    for cache in getattr(kv_decode_fast._decode_kernel, "device_caches", {}).values():
        for k in (cache[0] if isinstance(cache, tuple) else cache).values():
            found[id(k)] = k
    return found


def kernel_times(fn, reps: int = 10) -> dict[str, float]:
    """Mean device ms of each Triton kernel ``fn`` launches (names ending in ``_kernel``), over ``reps`` eager calls
    with the L2 flushed before each (as ``bench_kvquant.timeit``)."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / reps / 1e3 for e in prof.key_averages() if e.key.endswith("_kernel")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--cfg", default="", help="';'-separated kv_decode_fast.CFG overrides to run the parts under")
    ap.add_argument("--profile", action="store_true", help="3 untimed calls of one case (--case; --cfg: its first "
                    "setting), for a profiler")
    ap.add_argument("--case", type=int, default=1, help="--profile's case: 0 no outliers, 1 keys + values, 2 keys, "
                    "3 values, 4 a float16 cache (the same kernel's float path, for comparison)")
    ap.add_argument("--kernels", action="store_true", help="also each kernel's share (torch.profiler)")
    ap.add_argument("--key-live", type=float, default=1.0, help="share of the key slots holding an outlier (1%% "
                    "per-channel thresholds leave about half of their 2 x 1%% slots live)")
    args = ap.parse_args()
    L = args.length
    ko, vo = b.ONE_PCT
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, b.HQ, b.E, generator=gen, device="cuda", dtype=torch.float16)
    slots, lens = torch.arange(1, device="cuda"), torch.full((1,), L, device="cuda")
    base = dict(kv_decode_fast.CFG)
    cases = (("no outliers", (0, 0)), ("1% keys + values", (ko, vo)), ("1% keys only", (ko, 0)),
             ("1% values only", (0, vo)))
    if args.profile:
        b.set_cfg(args.cfg.split(";")[0])
        if args.case == 4:
            K = torch.randn(1, L, b.HKV, b.E, generator=gen, device="cuda", dtype=torch.float16)
            call = lambda: kv_decode_fast.float_kv_decode(q, slots, lens, K, K)  # noqa: E731
        else:
            K, V = b.quant_cache(1, L, *cases[args.case][1], gen, 4, args.key_live)
            call = lambda: quant_kv_decode(q, slots, lens, K, V, b.E, 10000.0)  # noqa: E731
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        return
    for cfg in ["", *filter(None, args.cfg.split(";"))]:
        kv_decode_fast.CFG.clear()
        kv_decode_fast.CFG.update(base)
        b.set_cfg(cfg)
        for name, slots_kv in cases:
            K, V = b.quant_cache(1, L, *slots_kv, gen, 4, args.key_live)
            before = _compiled()
            ms = b.timeit(lambda: quant_kv_decode(q, slots, lens, K, V, b.E, 10000.0))  # noqa: B023
            new = [k for i, k in _compiled().items() if i not in before]
            regs = ", ".join(f"{getattr(k, 'n_regs', '?')} regs / {getattr(k, 'n_spills', '?')} B spilled"
                             for k in new) or "cached"
            print(f"{cfg or 'CFG':28s} {L} tokens, 4-bit, {name:18s} {ms:.3f} ms  ({regs})", flush=True)
            if args.kernels:
                split = kernel_times(lambda: quant_kv_decode(q, slots, lens, K, V, b.E, 10000.0))  # noqa: B023
                print("    " + ", ".join(f"{k} {v:.3f}" for k, v in split.items()), flush=True)


if __name__ == "__main__":
    main()
