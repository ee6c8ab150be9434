"""Where a KVQuant format loses perplexity, one experiment at a time (CPU; the tables' calibration and windows).

    python benchmarks/diag_kvquant.py --model smollm2 split      # keys only / values only (other side int8)
    python benchmarks/diag_kvquant.py --model smollm2 dtypes     # nuq on one side, uniform on the other
    python benchmarks/diag_kvquant.py --model smollm2 slots      # unlimited key-outlier slots (no clipping)
    python benchmarks/diag_kvquant.py --model smollm2 fisher     # k-means weights Fisher^a, a = 0, 0.5, 1
    python benchmarks/diag_kvquant.py --model smollm2 calib --calib-seqlen 2048   # longer calibration windows
    python benchmarks/diag_kvquant.py --model smollm2 calib --calib-samples 64    # more calibration windows
    python benchmarks/diag_kvquant.py --model smollm2 knobs      # Q-Norm on each side, 4 sink tokens
    python benchmarks/diag_kvquant.py --model smollm2 pin        # key codebook ends kept at -1 / 1 too
    python benchmarks/diag_kvquant.py --model smollm2 layers     # one attention layer quantized at a time
    python benchmarks/diag_kvquant.py --model smollm2 tokens     # the worst-quantized p% of tokens kept in float
    python benchmarks/diag_kvquant.py --model smollm2 fisherclip --calib-seed 1   # k-means weights clipped
    python benchmarks/diag_kvquant.py --model smollm2 books      # a codebook per kv head / per channel
    python benchmarks/diag_kvquant.py --model smollm2 wide       # 64 windows spread over the whole test set
    python benchmarks/diag_kvquant.py --model smollm2 vrot       # values rotated per head (Hadamard), no outliers
    python benchmarks/diag_kvquant.py --model smollm2 perhead    # outlier slots split among the kv heads
    python benchmarks/diag_kvquant.py --model hybrid split --windows 64   # any experiment on such windows

``wide`` evaluates float KV, nuq4-1% and nuq3-1% on --windows (64) windows evenly spaced over the whole WikiText-2
test set instead of the first ones (the tables' first 8 windows of SmolLM2 are 4,096 tokens of one article); any
experiment takes --windows. Each other experiment evaluates ``--preset`` (default kvquant-nuq3-1%) and its variants with run_kvquant_table.py's
``evaluate`` (SmolLM2: the first 8 test windows of 512 tokens; hybrid: 16 of 1024), calibrated on --calib-samples
(16) windows of --calib-seqlen tokens (seed 0). The variants that change code (slots, fisher) patch one function
for their row and restore it. Prints one line a row.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from run_kvquant_table import WINDOWS, evaluate, load_calibrated, spec_of, spread_windows

import ssmq.models.kv_format as kv_format
import ssmq.ops.kv_quant as kv_quant
import ssmq.quant.kvquant.calibrate as calibrate
from ssmq.eval.perplexity import wikitext2_path
from ssmq.models.kv_format import KVSideSpec, KVSpec
from ssmq.models.kv_quantizer import KVQuantizer

ORIG_SLOTS, ORIG_FIT, ORIG_KMEANS = kv_format.KVSideSpec.outlier_slots, calibrate.fit_side, calibrate.weighted_kmeans
ORIG_FAKE_QUANT = KVQuantizer.fake_quant
ORIG_SELECT = kv_quant.select_outliers


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def _stack(*contexts):
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


def unlimited_slots(self, n):
    """Every entry beyond the per-channel thresholds kept (the paper's variable-length sparse rows)."""
    return n if self.outliers and self.granularity == "per_channel" else ORIG_SLOTS(self, n)


def pinned_kmeans(u, w, init, iters=40, pin_ends=False):
    """k-means with the end levels kept at -1 / 1 on every side (by default only on per-token ones)."""
    return ORIG_KMEANS(u, w, init, iters, pin_ends=True)


def fisher_power(a):
    def fit(kvq, which, x, fisher):
        return ORIG_FIT(kvq, which, x, fisher ** a)
    return fit


def float_tokens(p: float):
    """Each window's p of tokens whose K (or V) vectors the format quantizes worst (squared error over all kv heads)
    kept in float: a writer could pick them online by an error threshold (a token-level dense-and-sparse)."""
    def fake_quant(self, x, positions, which):
        out = ORIG_FAKE_QUANT(self, x, positions, which)
        err = (out - x).float().square().sum((-2, -1))  # (b, l)
        n = max(1, round(p * x.shape[1]))
        worst = torch.zeros_like(err, dtype=torch.bool).scatter_(1, err.topk(n, dim=1).indices, True)
        return torch.where(worst[..., None, None], x, out)
    return fake_quant


def fisher_clipped(q: float):
    """k-means weights clipped at their q-quantile: a few squared gradients can outweigh the rest of a layer."""
    def fit(kvq, which, x, fisher):
        flat = fisher.flatten()
        sample = flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))[:1 << 20]]
        return ORIG_FIT(kvq, which, x, fisher.clamp(max=sample.quantile(q).item()))
    return fit


def grouped_books(group: str, sides: str = "kv"):
    """fit_side, then one nuq codebook per kv head ("head") or per (kv head, channel) ("channel") of the sides
    ``sides``, each fitted like the layer's (Fisher-weighted k-means of that group's normalized non-outliers, from
    the layer's codebook). Kept on the quantizer as ``{k,v}_books`` (hkv, e, C); ``grouped_fake_quant`` uses them."""
    def fit(kvq, which, x, fisher):
        ORIG_FIT(kvq, which, x, fisher)
        side, tag = kvq.side(which), which[0]
        if tag not in sides or side.dtype != "nuq":
            return
        u, mask = calibrate.normalized(kvq, which, x)
        book = kvq.params(which).codebook
        books = book.expand(kvq.hkv, kvq.e, -1).clone()
        pin = side.granularity == "per_token"
        for h in range(kvq.hkv):
            chans = [slice(None)] if group == "head" else range(kvq.e)
            for c in chans:
                keep = ~mask[:, h, c]
                books[h, c] = ORIG_KMEANS(u[:, h, c][keep], fisher[:, h, c][keep] + 1e-30, book, pin_ends=pin)
        setattr(kvq, f"{tag}_books", books)
    return fit


def grouped_fake_quant(self, x, positions, which):
    """fake_quant with ``{k,v}_books``: each (head, channel) dequantized through its own codebook. Exact, since
    the outliers and scales do not depend on the codebook: run once per distinct codebook, keep its entries."""
    books = getattr(self, f"{which[0]}_books", None)
    if books is None:
        return ORIG_FAKE_QUANT(self, x, positions, which)
    import dataclasses
    from ssmq.ops.kv_quant import fake_quant_kv_ref
    p = self.params(which)
    out = torch.empty_like(x)
    flat = books.reshape(-1, books.shape[-1])
    uniq, inv = flat.unique(dim=0, return_inverse=True)
    inv = inv.reshape(books.shape[:2]).to(x.device)
    for j, b in enumerate(uniq):
        q = fake_quant_kv_ref(x, dataclasses.replace(p, codebook=b.to(x.device)))
        out = torch.where(inv == j, q, out)
    if self.kv.sink:
        out = torch.where((positions < self.kv.sink)[..., None, None], x, out)
    return out


def per_head_outliers(rounding):
    """select_outliers with a token's k slots split among its hkv kv heads: each (token, kv head) keeps its own
    rounding(k / hkv) (at least 1) by the same rule, as a decode that reads one kv head's slots with its codes would
    store them (fixed slots by kv head instead of by token). Per-channel thresholds then clip a head's excess even
    where another head of the token has slots to spare."""
    import dataclasses

    def select(x, p):
        if p.k == 0:
            return ORIG_SELECT(x, p)
        t, hkv, e = x.shape
        kh = max(1, rounding(p.k / hkv))
        parts = []
        for h in range(hkv):
            ph = dataclasses.replace(p, k=kh, lo=None if p.lo is None else p.lo[h:h + 1],
                                     hi=None if p.hi is None else p.hi[h:h + 1])
            idx, val, mask = ORIG_SELECT(x[:, h:h + 1], ph)
            parts.append((torch.where(idx >= 0, idx + h * e, -1), val, mask))
        idx, val = kv_quant.order_slots(torch.cat([q[0] for q in parts], 1), torch.cat([q[1] for q in parts], 1))
        return idx.to(torch.int16), val, torch.cat([q[2] for q in parts], 1)
    return select


def variants(experiment: str, full: KVSpec):
    """(label, spec, patch context) rows of one experiment."""
    none = contextlib.nullcontext
    i8 = KVSideSpec(8, "int", "per_token", symmetric=True)
    if experiment == "split":
        return [("float KV", None, none()), ("all", full, none()),
                ("keys only (values int8 per token-head)", KVSpec(full.keys, i8, full.sink), none()),
                ("values only (keys int8 per token-head)", KVSpec(i8, full.values, full.sink), none())]
    if experiment == "dtypes":
        return [("nuq keys, uniform values", full.with_changes(values={"dtype": "int"}), none()),
                ("uniform keys, nuq values", full.with_changes(keys={"dtype": "int"}), none())]
    if experiment == "slots":
        return [("fixed slots (2 x 1% a token)", full, none()),
                ("unlimited key-outlier slots", full, patched(kv_format.KVSideSpec, "outlier_slots",
                                                              unlimited_slots))]
    if experiment == "fisher":
        return [(f"k-means weights Fisher^{a}", full, patched(calibrate, "fit_side", fisher_power(a)))
                for a in (0.0, 0.5, 1.0)]
    if experiment == "knobs":
        from dataclasses import replace

        return [("Q-Norm on keys", full.with_changes(keys={"qnorm": True}), none()),
                ("Q-Norm on values", full.with_changes(values={"qnorm": True}), none()),
                ("4 sink tokens", replace(full, sink=4), none())]
    if experiment == "fisherclip":
        return [("Fisher weights as they are", full, none())] + [
            (f"Fisher weights clipped at their {q:.0%} quantile", full,
             patched(calibrate, "fit_side", fisher_clipped(q))) for q in (0.99, 0.9)]
    if experiment == "tokens":
        return [(f"worst {p:.1%} of tokens in float", full, patched(KVQuantizer, "fake_quant", float_tokens(p)))
                for p in (0.01, 0.02, 0.05)]
    if experiment == "wide":
        return [("float KV", None, none()), ("nuq4-1%", spec_of("kvquant-nuq4-1%"), none()),
                ("nuq3-1%", spec_of("kvquant-nuq3-1%"), none())]
    if experiment == "vrot":
        rotated = full.with_changes(values={"rotate": True, "outliers": 0.0})
        return [("as it is", full, none()), ("values rotated, no value outliers", rotated, none()),
                ("values rotated, uniform", rotated.with_changes(values={"dtype": "int"}), none())]
    if experiment == "calib":
        return [("float KV", None, none()), ("all", full, none())]
    if experiment == "perhead":
        import math

        def by_head(label, rounding):
            sel = per_head_outliers(rounding)  # calibration imports the name: patch both
            return (label, full, _stack(patched(kv_quant, "select_outliers", sel),
                                        patched(calibrate, "select_outliers", sel)))
        return [("slots by token (the default)", full, none()),
                by_head("slots by kv head, ceil(k / hkv) each", math.ceil),
                by_head("slots by kv head, floor(k / hkv) each (>= 1)", math.floor)]
    if experiment == "pin":
        return [("key ends free (the default)", full, none()),
                ("key ends pinned at -1 / 1", full, patched(calibrate, "weighted_kmeans", pinned_kmeans))]
    if experiment == "books":
        def rows(label, group, sides):
            return (label, full, none() if group is None else _stack(
                patched(calibrate, "fit_side", grouped_books(group, sides)),
                patched(KVQuantizer, "fake_quant", grouped_fake_quant)))
        return [rows("one codebook a layer (the default)", None, ""), rows("a codebook per kv head", "head", "kv"),
                rows("a codebook per channel, keys", "channel", "k"),
                rows("a codebook per channel, both sides", "channel", "kv")]
    raise SystemExit(f"diag_kvquant: unknown experiment {experiment!r}")


def one_layer_at_a_time(formats, spec: KVSpec, ids, seqlen: int, limit: int, args) -> None:
    """Perplexity with float KV, with every layer quantized, and with only layer L quantized (each attention layer
    in turn, the same calibrated quantizers): where the loss sits, and whether the layers' losses add up."""
    from ssmq.eval.perplexity import perplexity_of_ids

    base = evaluate(formats, None, ids, seqlen, limit, 2)["ppl"]
    full = evaluate(formats, spec, ids, seqlen, limit, 2)["ppl"]
    print(f"{args.model} {args.preset} float KV ppl {base:.4f}; all layers {full:.4f} ({full - base:+.4f})", flush=True)
    mixers = [formats.model.layers[i].mixer for i in formats.layers]
    quantizers = [m.kv_quant for m in mixers]
    total = 0.0
    for j, i in enumerate(formats.layers):
        for m, q in zip(mixers, quantizers):
            m.kv_quant = q if m is mixers[j] else None
        ppl = perplexity_of_ids(formats.model, ids, seqlen, 2, limit, progress=False)["ppl"]
        total += ppl - base
        print(f"{args.model} {args.preset} only layer {i:2d}: ppl {ppl:.4f} ({ppl - base:+.4f})", flush=True)
    print(f"{args.model} {args.preset} sum of the one-layer deltas {total:+.4f} vs all layers {full - base:+.4f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", choices=["split", "dtypes", "slots", "fisher", "calib", "knobs", "pin", "layers",
                                           "tokens", "fisherclip", "books", "wide", "vrot", "perhead"])
    ap.add_argument("--model", default="smollm2", choices=list(WINDOWS))
    ap.add_argument("--preset", default="kvquant-nuq3-1%")
    ap.add_argument("--calib-seqlen", type=int, default=512)
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--calib-seed", type=int, default=0, help="the draw of calibration windows (0: the tables')")
    ap.add_argument("--windows", type=int, default=0, help="evaluate on this many windows spread over the test set "
                    "(0: the tables' first windows; wide: 64)")
    args = ap.parse_args()
    limit, seqlen = WINDOWS[args.model]
    model, tok, _, formats = load_calibrated(args.model, args.calib_samples, args.calib_seqlen, args.calib_seed)
    ids = tok.encode(wikitext2_path("test").read_text(encoding="utf-8"))
    spread = args.windows or (64 if args.experiment == "wide" else 0)
    if spread:
        n = len(ids) // seqlen
        ids, limit = spread_windows(ids, seqlen, spread)
        print(f"{args.model}: {limit} windows of {seqlen} tokens, evenly spaced over {n} (test set {n * seqlen} "
              "tokens)", flush=True)
    if args.experiment == "layers":
        return one_layer_at_a_time(formats, spec_of(args.preset), ids, seqlen, limit, args)
    for label, spec, patch in variants(args.experiment, spec_of(args.preset)):
        with patch:
            formats._fitted.clear()  # every row calibrates under its own patch
            r = evaluate(formats, spec, ids, seqlen, limit, 2)
        bits = "16" if r["bits_per_entry"] is None else f"{r['bits_per_entry']:.2f}"
        print(f"{args.model} {args.preset} {label:42s} ppl {r['ppl']:.4f}  bits/entry {bits}", flush=True)


if __name__ == "__main__":
    main()
