"""``ssmq bench kernels``: a registry of kernel benchmarks, each a function that builds timed cases.

A benchmark is ``fn(ctx) -> list[Case]``: each case holds one or more implementations of the same call
(``ssmq``: the op as the models call it, a Triton kernel on a GPU and the PyTorch reference on the CPU; ``torch``
or ``reference``: the baseline) and the bytes the call must move, for GB/s. Add one with::

    @register("my-op", "what it times")
    def my_op(ctx: KernelContext) -> list[Case]:
        x = torch.randn(..., device=ctx.device, dtype=ctx.dtype)
        return [Case("label", {"ssmq": lambda: kernels.my_op(x), "reference": lambda: ops.my_op_ref(x)}, nbytes)]

Shapes come from a published architecture (``--shape``, default mamba2-2.7b; ``--layers`` is irrelevant here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ssmq.bench.output import lines_plot, record, table, write
from ssmq.bench.timing import time_fn
from ssmq.errors import SSMQError


@dataclass(frozen=True)
class Case:
    label: str  # shape of the call, e.g. "in_proj 10576x2560, 1 row"
    fns: dict[str, Callable[[], object]]  # implementation name -> the call
    nbytes: int | None = None  # bytes the call must read and write at least (for GB/s)
    rows: int | None = None  # the batch / row count of the case, for plots


@dataclass(frozen=True)
class KernelContext:
    device: torch.device
    dtype: torch.dtype
    cfg: object  # the ModelConfig whose shapes are timed
    rows: tuple[int, ...] = (1, 8, 32)


@dataclass(frozen=True)
class KernelBench:
    name: str
    description: str
    fn: Callable[[KernelContext], list[Case]] = field(repr=False)


KERNEL_BENCHES: dict[str, KernelBench] = {}


def register(name: str, description: str):
    """Decorator: add ``fn(ctx) -> list[Case]`` to the registry under ``name``."""
    def deco(fn):
        if name in KERNEL_BENCHES:
            raise ValueError(f"kernel benchmark {name!r} is registered twice")
        KERNEL_BENCHES[name] = KernelBench(name, description, fn)
        return fn
    return deco


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _linear_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(n, k) of the linears a decode step streams: in_proj, out_proj, lm_head."""
    d, di = cfg.d_model, cfg.d_inner
    n_in = 2 * di + 2 * cfg.ngroups * cfg.d_state + cfg.nheads if cfg.arch != "mamba1" else 2 * di
    return {"in_proj": (n_in, d), "out_proj": (d, di), "lm_head": (cfg.vocab_size, d)}


@register("linear", "16-bit decode GEMV/GEMM at the model's in_proj, out_proj and lm_head shapes, against F.linear")
def bench_linear(ctx: KernelContext) -> list[Case]:
    from ssmq import kernels

    cases = []
    for name, (n, k) in _linear_shapes(ctx.cfg).items():
        w = torch.randn(n, k, device=ctx.device, dtype=ctx.dtype)
        for m in ctx.rows:
            x = torch.randn(m, k, device=ctx.device, dtype=ctx.dtype)
            cases.append(Case(f"{name} {n}x{k}, {m} rows", {"ssmq": lambda x=x, w=w: kernels.linear(x, w),
                                                              "torch": lambda x=x, w=w: F.linear(x, w)},
                              _nbytes(w, x) + m * n * x.element_size(), m))
    return cases


@register("quant-linear", "int8 and int4 (group 128) weight-only and, on CUDA, FP8 W8A8 GEMV/GEMM at in_proj and "
                          "out_proj shapes, against the 16-bit F.linear; on CUDA also the decode GEMV on the "
                          "repacked codes (ssmq packed)")
def bench_quant_linear(ctx: KernelContext) -> list[Case]:
    from ssmq import kernels
    from ssmq.ops.quant_linear import pack_int4

    packed = None
    if ctx.device.type == "cuda":
        from ssmq.kernels import packed_gemv as packed
    cases = []
    for name, (n, k) in list(_linear_shapes(ctx.cfg).items())[:2]:
        w16 = torch.randn(n, k, device=ctx.device, dtype=ctx.dtype)
        w8 = torch.randint(-127, 128, (n, k), device=ctx.device, dtype=torch.int8)
        s8 = torch.rand(n, device=ctx.device) * 0.01 + 1e-3
        w4 = pack_int4(torch.randint(-8, 8, (n, k), device=ctx.device, dtype=torch.int8))
        s4 = torch.rand(n, k // 128, device=ctx.device) * 0.01 + 1e-3
        # ssmq packed (CUDA): packed_gemv on the codes as QuantLinear.bind_decode repacks them; "ssmq": the stored
        # layout's kernels
        words8 = packed.pack(w8) if packed is not None and packed.packs(w8, s8) else None
        words4 = packed.pack(w4) if packed is not None and packed.packs(w4, s4) else None
        for m in ctx.rows:
            x = torch.randn(m, k, device=ctx.device, dtype=ctx.dtype)
            out = m * n * x.element_size()
            for fmt, w, s, words in (("w8a16", w8, s8, words8), ("w4a16-g128", w4, s4, words4)):
                fns = {"ssmq": lambda x=x, w=w, s=s: kernels.quant_linear(x, w, s)}
                if words is not None and m <= packed.CFG["MAX_ROWS"]:  # the repacked codes' decode GEMV
                    fns["ssmq packed"] = lambda x=x, words=words, s=s, b=8 if w is w8 else 4: \
                        packed.packed_gemv(x, words, s, b)
                fns["torch 16-bit"] = lambda x=x, w=w16: F.linear(x, w)
                cases.append(Case(f"{name} {n}x{k} {fmt}, {m} rows", fns, _nbytes(w, s, x) + out, m))
            if ctx.device.type == "cuda":  # fp8 codes in and out of the GEMV: CUDA only
                w8f = w16.float().clamp(-400, 400).to(torch.float8_e4m3fn)
                xf, xs = x.float().clamp(-400, 400).to(torch.float8_e4m3fn), torch.ones((), device=ctx.device)
                cases.append(Case(f"{name} {n}x{k} fp8-w8a8, {m} rows", {
                    "ssmq": lambda x=xf, xs=xs, w=w8f, s=s8: kernels.quant_linear(x, w, s, None, xs, None, ctx.dtype),
                    "torch 16-bit": lambda x=x, w=w16: F.linear(x, w)}, _nbytes(w8f, s8, xf) + out, m))
    return cases


STATE_KINDS = ("16-bit", "int8 row scales", "int8 table")


def state_update_inputs(kind: str, b: int, slots: int, shape: tuple[int, int, int, int], dev, f, gen):
    """The arguments of ``quant_state_update`` but the last (state_batch_indices) for one Mamba-2 decode step of b
    rows over a state of ``slots`` rows, and the bytes the step moves besides the state. kind: a ``STATE_KINDS``
    entry: a 16-bit state; an int8 state with row scales (int8-state); an int8 state with a (16, n) scale table on
    int8 x / B / C codes (Quamba2). shape: (heads, headdim, d_state, ngroups)."""
    from ssmq.ops.quant_ssm import RowScales

    h, p, n, g = shape
    int8 = kind != "16-bit"
    A = (-torch.rand(h, device=dev, generator=gen))[:, None, None].expand(h, p, n)
    D = torch.randn(h, device=dev, generator=gen)[:, None].expand(h, p)
    dt_bias = torch.randn(h, device=dev, generator=gen)[:, None].expand(h, p)
    dt = torch.randn(b, h, device=dev, dtype=f, generator=gen)[:, :, None].expand(b, h, p)
    state = (torch.randint(-128, 128, (slots, h, p, n), device=dev, dtype=torch.int8, generator=gen) if int8
             else torch.randn(slots, h, p, n, device=dev, dtype=f, generator=gen) * 0.1)
    io = b * h * 2  # dt
    if kind == "int8 table":
        table = torch.rand(16, n, device=dev, generator=gen) * 0.01 + 1e-3
        index = torch.randint(0, 16, (h * p,), device=dev, generator=gen)
        x = torch.randint(-128, 128, (b, h, p), device=dev, dtype=torch.int8, generator=gen)
        B, C = (torch.randint(-128, 128, (b, g, n), device=dev, dtype=torch.int8, generator=gen) for _ in range(2))
        xs = torch.rand(h, p, device=dev, generator=gen) * 0.01 + 1e-3
        Bs, Cs = torch.full((g, n), 0.01, device=dev), torch.full((g, n), 0.01, device=dev)
        io += b * h * p * 3 + 2 * b * g * n
    else:
        table = RowScales(torch.rand(slots, h, p, device=dev, generator=gen) * 0.01 + 1e-3) if int8 else None
        index = xs = Bs = Cs = None
        x = torch.randn(b, h, p, device=dev, dtype=f, generator=gen)
        B, C = (torch.randn(b, g, n, device=dev, dtype=f, generator=gen) for _ in range(2))
        io += b * h * p * 4 + 4 * b * g * n + (b * h * p * 8 if int8 else 0)
    return (state, table, index, x, xs, dt, A, B, Bs, C, Cs, D, None, dt_bias, True), io


@register("state-update", "the Mamba-2 SSM state update of one decode step (heads x headdim x d_state a row): a "
                          "16-bit state, an int8 state with row scales (int8-state), an int8 state with a 16-group "
                          "table on int8 inputs (Quamba2); against the PyTorch reference")
def bench_state_update(ctx: KernelContext) -> list[Case]:
    from ssmq import kernels
    from ssmq.ops.quant_ssm import quant_state_update_ref

    cfg, dev, f = ctx.cfg, ctx.device, ctx.dtype
    if cfg.arch == "mamba1":
        raise SSMQError("state-update times the Mamba-2 layout; pick a Mamba-2 --shape")
    h, p, n, g = cfg.nheads, cfg.headdim, cfg.d_state, cfg.ngroups
    gen = torch.Generator(device=dev).manual_seed(0)
    cases = []
    for b in ctx.rows:
        for kind in STATE_KINDS:
            args, io = state_update_inputs(kind, b, b, (h, p, n, g), dev, f, gen)
            state = args[0]
            args = (*args, None)  # state_batch_indices: the rows in order
            nbytes = 2 * state.numel() * state.element_size() + io
            cases.append(Case(f"{kind}, {h} heads x {p} x {n}, batch {b}", {
                "ssmq": lambda a=args: kernels.quant_state_update(*a, out_dtype=f),
                "reference": lambda a=args: quant_state_update_ref(*a, out_dtype=f)}, nbytes, b))
    return cases


@register("moe", "the grouped-GEMM experts of a MoE block (kernels.moe_experts: [gate | up] + activation, down x "
                 "routing weight) at the model's MoE shape (e.g. --shape granite-4.0-h-tiny), float and with int8, "
                 "int4 (group 128) weight-only and FP8 W8A8 experts; GB/s counts the routed experts' weights once")
def bench_moe(ctx: KernelContext) -> list[Case]:
    from ssmq import kernels
    from ssmq.ops.quant_linear import pack_int4

    cfg, dev = ctx.cfg, ctx.device
    if not cfg.moe_layer_idx:
        raise SSMQError(f"moe times a MoE block; {cfg.family or cfg.arch} at this --shape has none")
    d, f, E, k = cfg.d_model, cfg.moe_hidden, cfg.moe_experts, cfg.moe_top_k
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = {"up": (f, d), "down": (d, f), "gate": (f, d)}

    def stack(fmt, n, kk):
        """(weights, scales) of E experts' (n, kk) linears in ``fmt``."""
        if fmt == "float":
            return torch.randn(E, n, kk, device=dev, generator=gen).to(ctx.dtype) / kk ** 0.5, None
        s = torch.rand(E, n, *((kk // 128,) if fmt == "w4a16-g128" else ()), device=dev, generator=gen) * 0.01 + 1e-3
        if fmt == "fp8-w8a8":
            return (torch.randn(E, n, kk, device=dev, generator=gen) * 100).clamp(-448, 448).to(
                torch.float8_e4m3fn), s
        lim = 8 if fmt == "w4a16-g128" else 128
        q = torch.randint(-lim, lim, (E, n, kk), device=dev, dtype=torch.int8, generator=gen)
        return (pack_int4(q) if fmt == "w4a16-g128" else q), s

    cases = []
    for fmt in ("float", "w8a16", "w4a16-g128", "fp8-w8a8"):
        w = {name: stack(fmt, *shape) for name, shape in shapes.items()}
        scales = None if fmt == "float" else (w["up"][1], w["down"][1], w["gate"][1])
        for m in ctx.rows:
            x = torch.randn(m, d, device=dev, dtype=ctx.dtype, generator=gen)
            idx = torch.stack([torch.randperm(E, device=dev, generator=gen)[:k] for _ in range(m)])
            rw = torch.rand(m, k, device=dev, generator=gen).softmax(-1)
            routed = idx.unique().numel()
            nbytes = _nbytes(x) * 2 + sum(_nbytes(*(t for t in ws if t is not None)) for ws in w.values()) \
                * routed // E
            cases.append(Case(f"{E} experts {d}x{f} top-{k} {fmt}, {m} rows", {
                "ssmq": lambda x=x, rw=rw, idx=idx, w=w, sc=scales, fp8=fmt == "fp8-w8a8": kernels.moe_experts(
                    x, rw, idx, w["up"][0], w["down"][0], w["gate"][0], "silu", sc, fp8)}, nbytes, m))
    return cases


def shape_config(name: str):
    """The config of the published architecture whose shapes are timed (``--shape``)."""
    from ssmq.bench.models import published_config

    cfg = published_config(name)
    if cfg is None:
        from ssmq.models.published import PUBLISHED

        raise SSMQError(f"unknown --shape {name!r}; one of: {', '.join(PUBLISHED)}")
    return cfg


def run(args) -> dict:
    from ssmq.bench.models import device_and_dtype

    device, dtype = device_and_dtype(args.device, args.dtype)
    cfg = shape_config(args.shape)
    names = args.only or list(KERNEL_BENCHES)
    unknown = [n for n in names if n not in KERNEL_BENCHES]
    if unknown:
        raise SSMQError(f"unknown kernel benchmark {unknown[0]!r}; one of: {', '.join(KERNEL_BENCHES)}")
    ctx = KernelContext(device, dtype, cfg, tuple(args.rows))
    result = record("kernels", device, shape=args.shape, dtype=str(dtype).removeprefix("torch."),
                    l2_flush=args.l2_flush, warmup=args.warmup, reps=args.reps)
    cases = [(n, c) for n in names for c in KERNEL_BENCHES[n].fn(ctx)]
    bw = None
    if device.type == "cuda" and any(c.nbytes for _, c in cases):  # the ceiling of a streaming kernel, this run's
        from ssmq.bench.timing import copy_bandwidth

        bw = copy_bandwidth()
        result["copy_bandwidth_GBps"] = bw / 1e9
    for bench, case in tqdm(cases, desc="kernels", unit="case"):
        for impl, fn in case.fns.items():
            row = {"bench": bench, "case": case.label, "impl": impl, "rows": case.rows}
            try:
                t = time_fn(fn, device, args.warmup, args.reps, l2_flush=args.l2_flush)
            except Exception as e:  # one case that cannot run is reported in its row, the others still run
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                result["rows"].append(row)
                continue
            row["us"] = t.median_ms * 1e3
            if case.nbytes and impl == "ssmq":
                row["GB_s"] = case.nbytes / (t.median_ms * 1e-3) / 1e9
                if bw:  # % of the device-to-device copy bandwidth (bytes read + written)
                    row["pct_copy"] = 100 * row["GB_s"] * 1e9 / bw
            result["rows"].append(row)
    if bw:
        print(f"device-to-device copy: {bw / 1e9:.0f} GB/s (read + written)")
    print(table(result["rows"], ["bench", "case", "impl", "us", "GB_s", "pct_copy", "error"]))
    for path in write(result, args.out, plot=_plot):
        print(f"wrote {path}")
    return result


def _plot(pyplot, result):
    rows = [{**r, "series": f"{r['bench']} {r['impl']}"} for r in result["rows"] if r.get("rows") and "us" in r]
    return lines_plot(pyplot, {**result, "rows": rows}, "rows", "us", "series", "rows (batch)", "µs per call")
