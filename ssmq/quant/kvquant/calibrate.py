"""KVQuant calibration: the offline part of a KV format, per attention layer, from calibration windows.

Glossary: N calibration tokens, hkv kv heads, e head dim, f outlier fraction, C codebook levels.

For every attention layer the keys and values its cache would store (keys before or after RoPE, as the spec says)
are captured together with their diagonal Fisher estimate, the squared gradient of the next-token loss w.r.t.
them (one backward pass per batch; the weights stay frozen). Then, per side:
    per_channel / per_tensor range   min / max over the tokens, or the f/2 and 1 - f/2 quantiles per channel
                                     when the side has outliers (the thresholds beyond which entries go sparse)
    nuq codebook                     Fisher-weighted k-means of the normalized non-outlier values, from the
                                     uniform grid (``kmeans.weighted_kmeans``); per-token sides keep levels
                                     at ±1, where every vector's min and max land
    Q-Norm                           the codebook's mean / std matched to the data's (``kmeans.q_norm``)
The first ``sink`` tokens of every window are left out of all of it (they are never quantized). The layer gets a
``KVQuantizer`` with these tensors (``Attention.kv_quant``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ssmq.models.hybrid import Attention
from ssmq.models.kv_format import KVSpec
from ssmq.models.kv_quantizer import KVQuantizer
from ssmq.ops.attention import rope_ref
from ssmq.ops.kv_quant import rotate_heads, scales_of, select_outliers, token_scales
from ssmq.quant.kvquant.kmeans import q_norm, weighted_kmeans

MAX_KMEANS_SAMPLES = 1 << 20


def attention_layers(model: nn.Module) -> list[int]:
    return [i for i, layer in enumerate(model.layers) if isinstance(layer.mixer, Attention)]


def capture_kv(model: nn.Module, windows: torch.Tensor, batch_size: int = 4) -> dict[int, dict[str, torch.Tensor]]:
    """{layer: {"k", "v", "gk", "gv"}}: pre-RoPE keys, values (B, l, hkv, e) float32 and the loss's gradients
    w.r.t. them (B windows of l tokens), with float KV whatever quantizers the model's layers carry."""
    layers = attention_layers(model)
    grabbed: dict[tuple[int, str], torch.Tensor] = {}

    def hook(i, which):
        def fn(module, inputs, out):
            out = out.detach().requires_grad_(True)
            grabbed[(i, which)] = out
            return out
        return fn

    handles = [model.layers[i].mixer.get_submodule(f"{w}_proj").register_forward_hook(hook(i, w))
               for i in layers for w in "kv"]
    # float KV while capturing: an installed quantizer's rounding (zero gradient) would empty the Fisher, and its
    # error would reach the later layers' K / V
    installed = {i: model.layers[i].mixer.kv_quant for i in layers}
    for i in layers:
        model.layers[i].mixer.kv_quant = None
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    out: dict[int, dict[str, list]] = {i: {"k": [], "v": [], "gk": [], "gv": []} for i in layers}
    dev = model.norm_f.weight.device
    try:
        for s in range(0, windows.shape[0], batch_size):
            ids = windows[s:s + batch_size].to(dev)
            with torch.enable_grad():
                logits = model(ids)
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
                loss.backward()
            for i in layers:
                m = model.layers[i].mixer
                for w in "kv":
                    t = grabbed.pop((i, w))
                    shape = (-1, ids.shape[1], m.hkv, m.e)
                    out[i][w].append(t.detach().float().reshape(shape).cpu())
                    out[i][f"g{w}"].append(t.grad.float().reshape(shape).cpu())
    finally:
        for h in handles:
            h.remove()
        for i, q in installed.items():
            model.layers[i].mixer.kv_quant = q
        for p in params:
            p.requires_grad_(True)
    return {i: {k: torch.cat(v) for k, v in d.items()} for i, d in out.items()}


def _post_rope(x: torch.Tensor, mixer) -> torch.Tensor:
    """x (B, l, hkv, e) at positions 0..l-1 rotated by RoPE. Applied to a key's gradient too: RoPE is orthogonal
    per position, so the gradient w.r.t. the rotated key is the rotated gradient (its Fisher needs no new pass)."""
    return rope_ref(x, torch.arange(x.shape[1]).expand(x.shape[0], -1), mixer.rotary_dim, mixer.rope_theta)


def normalized(kvq: KVQuantizer, which: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, hkv, e) as the side's codes see it, u in [-1, 1] (its range or each (token, head)'s scales, whose
    ranges leave the outliers out), and the outlier mask (N, hkv, e) under the side's current range."""
    side, p = kvq.side(which), kvq.params(which)
    _, _, mask = select_outliers(x, p)
    if side.granularity == "per_token":
        mid, half = token_scales(x, mask, side.symmetric)
        mid, half = mid.float()[..., None], half.float()[..., None]
    else:
        mid, half = scales_of(None, p, x.device)
    return ((x - mid) / half).clamp(-1, 1), mask


@torch.no_grad()
def fit_side(kvq: KVQuantizer, which: str, x: torch.Tensor, fisher: torch.Tensor) -> None:
    """Offline range, codebook and Q-Norm of one side from samples x (N, hkv, e) and their Fisher (N, hkv, e)."""
    side, tag = kvq.side(which), which[0]
    if side.rotate:
        x = rotate_heads(x, getattr(kvq, f"{tag}_signs"))
        # the rotated Fisher is not diagonal; its diagonal's expectation over the random signs is each (token, head)'s
        # mean over channels (the cross terms cancel), which keeps the tokens' weights for a nuq codebook
        fisher = fisher.mean(-1, keepdim=True).expand_as(x)
    f = side.outliers
    if side.granularity == "per_channel":
        lo, hi = (x.quantile(f / 2, 0), x.quantile(1 - f / 2, 0)) if f else (x.amin(0), x.amax(0))
    elif side.granularity == "per_tensor":
        lo, hi = x.amin(), x.amax()
    if side.granularity != "per_token":
        getattr(kvq, f"{tag}_lo").copy_(lo)
        getattr(kvq, f"{tag}_hi").copy_(hi)
    if side.dtype != "nuq" and not side.qnorm:
        return
    u, mask = normalized(kvq, which, x)
    u, w = u[~mask], fisher[~mask] + 1e-30
    if u.numel() > MAX_KMEANS_SAMPLES:  # a fixed subsample keeps k-means cheap and deterministic
        keep = torch.randperm(u.numel(), generator=torch.Generator().manual_seed(0))[:MAX_KMEANS_SAMPLES]
        u, w = u[keep], w[keep]
    book = getattr(kvq, f"{tag}_codebook")
    # per-token min-max scales put each (token, head)'s extremes at exactly ±1: the codebook keeps levels there
    c = weighted_kmeans(u, w, book, pin_ends=side.granularity == "per_token") if side.dtype == "nuq" else book.clone()
    book.copy_(q_norm(u, c) if side.qnorm else c)


@torch.no_grad()
def calibrate_kv_(model: nn.Module, spec: KVSpec, windows: torch.Tensor, batch_size: int = 4,
                  captured: dict | None = None) -> dict:
    """Give every attention layer of ``model`` a calibrated ``KVQuantizer`` for ``spec``; returns a summary.
    ``captured``: ``capture_kv``'s result for these windows, reused (tables calibrate many formats on one pass)."""
    data = captured if captured is not None else capture_kv(model, windows, batch_size)
    summary = {}
    for i, d in data.items():
        mixer = model.layers[i].mixer
        mixer.kv_quant = None
        kvq = KVQuantizer(spec, mixer.hkv, mixer.e, i)
        k, gk = d["k"], d["gk"]
        if not spec.keys.pre_rope:
            k, gk = _post_rope(k, mixer), _post_rope(gk, mixer)
        s = spec.sink  # the sink tokens stay float: their (often extreme) keys and values must not set ranges
        fit_side(kvq, "keys", k[:, s:].flatten(0, 1), gk[:, s:].flatten(0, 1).square())
        fit_side(kvq, "values", d["v"][:, s:].flatten(0, 1), d["gv"][:, s:].flatten(0, 1).square())
        mixer.kv_quant = kvq.to(model.norm_f.weight.device)
        summary[i] = {"tokens": int(k.shape[0] * (k.shape[1] - s))}
    return summary
