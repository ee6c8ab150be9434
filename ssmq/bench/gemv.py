"""Decode GEMV micro-benchmark: the linears of a decode step at published shapes, per weight format and batch.

    python -m ssmq.bench.gemv --models mamba2-2.7b,mamba2-8b --rows 1,2,4,8 --json out/gemv.json

Each op (in_proj and out_proj of each model; fp16 weights on the float GEMV, W4A16 g128, W8A16 per channel and
FP8 W8A8 with fp8 x codes on the low-bit kernels; random weights) is timed two ways, both from CUDA-graph replays
with CUDA events: ``flushed_us``, one call after a 256 MB write that evicts L2 (median of --reps), and
``stream_us``, calls back to back over weight copies larger than L2 (a decode step's situation). ``variants``
maps a name to launch-setting overrides of ``kernels.qgemv`` / ``kernels.packed_gemv``, in force while the op is
captured (``old``: the stored layout's kernels as shipped, ``new``: ``packed_gemv`` on the codes repacked by
``kernels.pack_for_decode`` wherever it serves the call). Achieved bandwidth counts the
weight bytes (codes and scales) over the flushed time, against the device-to-device copy bandwidth measured in the
same run (bytes read plus written). ``--floor P,...`` times, beside each op, a kernel that only reads the op's
weight bytes with about P programs an SM (``ssmq.bench.read_floor``; variants ``floor-P``): the least time a separate
kernel takes for those bytes. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time

import torch

from ssmq.bench.timing import copy_bandwidth
from ssmq.models.published import PUBLISHED

FORMATS = ("fp16", "w4a16-g128", "w8a16", "fp8-w8a8")
# launch-setting overrides: {module: overrides} for kernels.qgemv and kernels.packed_gemv (a flat dict: qgemv's).
# old: the stored layout's kernels as configs/qgemv.json routes them; new: packed_gemv on the repacked codes for
# every call it serves; qgemv: the stored layout's qgemv for every call it serves
_PACKED_OFF, _PACKED_ALL = {"ROUTE_ROWS": dict(int4=0, int8=0)}, {"ROUTE_ROWS": dict(int4=8, int8=8)}
VARIANTS = {"old": {"packed_gemv": _PACKED_OFF}, "new": {"packed_gemv": _PACKED_ALL}}


def _median_ms(fn, flush, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()  # evicts L2 (256 MB)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def shapes(name: str) -> dict[str, tuple[int, int]]:
    """(n, k) of the decode step's per-layer linears of a published Mamba-2 config."""
    c = PUBLISHED[name]
    return {"in_proj": (2 * c.d_inner + 2 * c.ngroups * c.d_state + c.nheads, c.d_model),
            "out_proj": (c.d_model, c.d_inner)}


def make_op(fmt: str, n: int, k: int):
    """(weights factory, op(x, weights)) of one format, through ``kernels``' dispatch; x is float16 (fp8-w8a8: its
    e4m3 codes, quantized outside the timed op as the fused norm hands them over)."""
    from ssmq import kernels
    from ssmq.ops.quant_linear import pack_int4

    ql = kernels.quant_linear
    dev = "cuda"
    if fmt == "fp16":
        return (lambda: (torch.randn(n, k, device=dev, dtype=torch.float16),)), lambda x, w: kernels.linear(x, w[0])
    from ssmq.kernels.packed_gemv import pack

    def with_words(w_q, s):  # the stored weight and the decode GEMV's repacked codes (QuantLinear.bind_decode's)
        return w_q, s, pack(w_q)

    def op_words(x, w):
        return ql(x, w[0], w[1], None, None, None, None, w[2])

    if fmt == "w4a16-g128":
        return (lambda: with_words(pack_int4(torch.randint(-8, 8, (n, k), device=dev, dtype=torch.int8)),
                                   torch.rand(n, k // 128, device=dev) * 0.01 + 1e-3)), op_words
    if fmt == "w8a16":
        return (lambda: with_words(torch.randint(-128, 128, (n, k), device=dev, dtype=torch.int8),
                                   torch.rand(n, device=dev) * 0.01 + 1e-3)), op_words
    if fmt == "fp8-w8a8":
        return (lambda: (torch.randn(n, k, device=dev).clamp(-400, 400).to(torch.float8_e4m3fn),
                         torch.rand(n, device=dev) * 0.01 + 1e-3)), \
            lambda x, w: ql(x[0], w[0], w[1], None, x[1], None, torch.float16)
    raise ValueError(fmt)


@contextlib.contextmanager
def _variant(overrides: dict):
    """A variant's overrides in force inside the block: {"qgemv": {...}, "packed_gemv": {...}} or qgemv's flat."""
    from ssmq.kernels import packed_gemv, qgemv

    mods = {"qgemv": qgemv.CFG, "packed_gemv": packed_gemv.CFG}
    nested = overrides and set(overrides) <= set(mods)
    parts = overrides.items() if nested else [("qgemv", overrides)]
    with contextlib.ExitStack() as stack:
        for name, o in parts:
            stack.enter_context(_overrides(mods[name], o))
        yield


@contextlib.contextmanager
def _overrides(cfg: dict, new: dict):
    """``cfg`` updated with ``new`` inside the block, restored after."""
    old = dict(cfg)
    cfg.update(new)
    try:
        yield
    finally:
        cfg.clear()
        cfg.update(old)


def _weight_bytes(w: tuple) -> int:
    """A weight's bytes as a GEMV reads them: codes and scales (not the repacked copy)."""
    return sum(t.numel() * t.element_size() for t in w[:2])


def time_op(make_w, op, fmt: str, rows: int, k: int, flush, reps: int, stream: bool = True) -> dict:
    """{"flushed_us", "stream_us", "bytes"} of op at ``rows`` rows (see the module docstring)."""
    from ssmq.ops.quant_linear import quantize_act_ref

    w0 = make_w()
    wbytes = _weight_bytes(w0)
    x = torch.randn(rows, k, device="cuda", dtype=torch.float16)
    if fmt == "fp8-w8a8":
        x = quantize_act_ref(x, None, True, torch.float8_e4m3fn)
    op(x, w0)  # compile outside the captures
    torch.cuda.synchronize()
    g1 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1):
        op(x, w0)
    flushed = _median_ms(g1.replay, flush, reps) * 1e3
    if not stream:
        return {"flushed_us": flushed, "bytes": wbytes}
    copies = [w0] + [make_w() for _ in range(min(31, max(1, math.ceil((400 << 20) / wbytes)) - 1))]
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        for w in copies:
            op(x, w)
    stream_us = _median_ms(g2.replay, None, 10) * 1e3 / len(copies)
    del g1, g2, copies
    return {"flushed_us": flushed, "stream_us": stream_us, "bytes": wbytes}


def _timed(make_w, op, fmt, rows, k, flush, reps, stream, cfg) -> dict:
    """time_op under a variant's overrides, with the achieved bandwidth; an op that cannot run is reported."""
    try:
        with _variant(cfg):
            r = time_op(make_w, op, fmt, rows, k, flush, reps, stream)
        r["GBps"] = r["bytes"] / r["flushed_us"] / 1e3
        return r
    except Exception as e:  # one op that cannot run is reported, not fatal
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}


def run(models, formats, rows_list, variants, reps=30, log=print, stream=True, linears=None, floor=()) -> dict:
    if floor:
        from ssmq.bench.read_floor import read_op  # Triton: imported only where a floor is timed
    bw = copy_bandwidth()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "torch": torch.__version__, "copy_bandwidth_GBps": bw / 1e9, "ops": []}
    for model in models:
        for lin, (n, k) in shapes(model).items():
            if linears and lin not in linears:
                continue
            for fmt in formats:
                make_w, op = make_op(fmt, n, k)
                for rows in rows_list:
                    for vname, cfg in (variants.items() if fmt != "fp16" else [("old", {})]):
                        r = _timed(make_w, op, fmt, rows, k, flush, reps, stream, cfg)
                        r.update(model=model, linear=lin, n=n, k=k, format=fmt, rows=rows, variant=vname)
                        res["ops"].append(r)
                        log(json.dumps(r))
                nbytes = _weight_bytes(make_w()) if floor else 0
                for p in floor:  # the op's bytes read by a kernel that does nothing else, under every row count
                    r = _timed(*read_op(nbytes, p), fmt, 1, k, flush, reps, stream, {})
                    for rows in rows_list:
                        res["ops"].append({**r, "model": model, "linear": lin, "n": n, "k": k, "format": fmt,
                                           "rows": rows, "variant": f"floor-{p}"})
                    log(json.dumps(res["ops"][-1]))
                torch.cuda.empty_cache()
    for r in res["ops"]:
        if "GBps" in r:
            r["bw_share"] = r["GBps"] * 1e9 / bw
    return res


def table(res: dict) -> str:
    """One line per (model, linear, format, rows): flushed µs of each variant, bandwidth share of the best."""
    lines = [f"{res['device']}, copy bandwidth {res['copy_bandwidth_GBps']:.0f} GB/s, {res['date']}",
             "model       linear    format      rows  old_us  new_us  old_stream  new_stream  new_bw%"]
    keyed: dict = {}
    for r in res["ops"]:
        keyed.setdefault((r["model"], r["linear"], r["format"], r["rows"]), {})[r["variant"]] = r
    names = sorted({r["variant"] for r in res["ops"]} - {"old", "new"})
    if names:  # further variants: flushed / stream us
        lines[1] += "  " + "  ".join(f"{x:>{max(len(x), 11)}s}" for x in names)
    for (m, lin, fmt, rows), v in keyed.items():
        o, n = v.get("old", {}), v.get("new", {})
        f = lambda d, key: f"{d[key]:.2f}" if key in d else "-"  # noqa: E731
        share = f"{100 * n['bw_share']:.0f}" if "bw_share" in n else "-"
        both = lambda d: f"{f(d, 'flushed_us')}/{f(d, 'stream_us')}"  # noqa: E731
        lines.append(f"{m:11s} {lin:9s} {fmt:11s} {rows:4d} {f(o, 'flushed_us'):>7s} {f(n, 'flushed_us'):>7s} "
                     f"{f(o, 'stream_us'):>10s} {f(n, 'stream_us'):>11s} {share:>8s}"
                     + "".join(f"  {both(v.get(x, {})):>{max(len(x), 11)}s}" for x in names))
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mamba2-2.7b,mamba2-8b")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--variants", default="", help="JSON {name: {module: CFG overrides}} for modules qgemv, packed_gemv "
                    "(a flat dict: qgemv's; default: old, new)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--linears", default="", help="comma list of in_proj, out_proj (default: both)")
    ap.add_argument("--no-stream", action="store_true", help="the flushed timing only")
    ap.add_argument("--floor", default="", help="comma list of programs an SM: time a read-only kernel of each op's "
                    "bytes beside it (ssmq.bench.read_floor)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_gemv: needs a CUDA GPU")
    variants = json.loads(args.variants) if args.variants else VARIANTS
    res = run(args.models.split(","), args.formats.split(","), [int(r) for r in args.rows.split(",")], variants,
              args.reps, stream=not args.no_stream, linears=[x for x in args.linears.split(",") if x],
              floor=[int(p) for p in args.floor.split(",") if p])
    res["command"] = "python -m ssmq.bench.gemv " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    print(table(res))


if __name__ == "__main__":
    main()
