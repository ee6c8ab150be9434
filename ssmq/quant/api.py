"""The one quantization pipeline: ``check(recipe, model)`` and ``quantize(model, recipe, calib)``.

Order (``docs/architecture.md``): ``check`` refuses what does not apply, before any work -> KV format
calibrated on the float model (``ssmq.quant.kvquant``: the Fisher needs float gradients) -> transforms in
recipe order (``TRANSFORMS``; smoothquant and sort_cluster calibrate their own statistics) -> SSM taps
calibrated and swapped for ``ActQuantizer``s -> linears: static activation scales and GPTQ Hessians observed
in calibration passes (after the taps are quantized, as the layers will see them; the input of a
``RotatedLinear`` after its online rotation) -> ``QuantLinear`` swap -> int8 conv1d (``QuantConv1d``: its input
scale observed at the quantized in_proj's output) -> head-to-toe embedding -> int8 SSM
state scales (from states of the quantized model). A recipe with a ``search`` is quantized twice (itself and
at 16-bit activations) and each layer is taken from one of the two (``ssm/mixed.py``).
The result carries ``model.quantization`` = {"recipe": ..., "calibration": ...} for the checkpoint.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.nn as nn

from ssmq.errors import SSMQError
from ssmq.ops.ssd_int8 import SSDi8Options
from ssmq.quant.calibration import CalibrationData, Hooks, attach_observers, match_modules, run_calibration
from ssmq.quant.gptq import HessianAccumulator, gptq_quantize
from ssmq.quant.hadamard import RotatedLinear, hadamard_transform, has_hadamard
from ssmq.quant.linear import QuantEmbedding, QuantLinear
from ssmq.quant.observers import MinMaxObserver, make_observer
from ssmq.quant.primitives import PerChannel, PerGroup, PerTensor
from ssmq.quant.recipe import Recipe, Rule, get_recipe
from ssmq.quant.rotation import rotate_model_, rotation_sizes
from ssmq.quant.smoothquant import apply_smoothing_, smoothing_scales, smoothquant_groups
from ssmq.quant.ssm import ssdi8
from ssmq.quant.ssm.permute import permutable_block
from ssmq.quant.ssm.transforms import hadamard_y_, sort_and_cluster_, ssm_layers


def plan(recipe: Recipe, model: nn.Module) -> dict[str, Rule]:
    """{linear path: rule} — the first matching rule of each nn.Linear."""
    out: dict[str, Rule] = {}
    for rule in recipe.linears:
        for p in match_modules(model, rule.modules, rule.exclude, kinds=(nn.Linear,)):
            out.setdefault(p, rule)
    return out


def check(recipe, model: nn.Module) -> dict[str, Rule]:
    """Refuse (SSMQError) a recipe that does not apply to ``model``, touching nothing; its linear plan otherwise."""
    recipe = get_recipe(recipe)
    cfg, name = model.config, f"recipe {recipe.name!r}"
    if cfg.arch not in recipe.supported_archs:
        raise SSMQError(f"{name} supports {', '.join(recipe.supported_archs)}, not {cfg.arch}")
    for rule in recipe.taps:
        if cfg.arch not in rule.archs:
            continue
        if rule.layout == "cluster" and not recipe.has("sort_cluster"):
            raise SSMQError(f"{name}: the cluster layout of {rule.taps} needs the sort_cluster transform")
        if rule.layout == "cluster" and rule.taps != ["act_x"]:
            raise SSMQError(f"{name}: only act_x has cluster scales, not {rule.taps}")
        if rule.layout == "state_group" and (set(rule.taps) - {"act_B", "act_C"} or cfg.d_state % rule.state_groups):
            raise SSMQError(f"{name}: state_group scales are for act_B/act_C with state_groups dividing d_state "
                            f"{cfg.d_state}")
    for t in recipe.transforms:
        sizes = {}
        if t.name == "hadamard":
            sizes = rotation_sizes(model, t.get("online"))
        elif t.name == "hadamard_y":
            sizes = {"d_inner": cfg.d_inner}
        for what, n in sizes.items():
            if not has_hadamard(n):
                raise SSMQError(f"{name}: no Hadamard matrix of order {n} ({what})")
        if t.name == "sort_cluster" and cfg.arch == "mamba2":
            permutable_block(cfg)
    _check_ssdi8(recipe, cfg, name)
    _check_kv(recipe, model, name)
    targets = plan(recipe, model)
    if recipe.linears and not targets:
        raise SSMQError(f"{name} matches no linear module of this {cfg.arch} model")
    for rule in recipe.linears:
        if not match_modules(model, rule.modules, rule.exclude, kinds=(nn.Linear,)):
            raise SSMQError(f"{name}: rule {rule.modules} matches no linear module of this {cfg.arch} model")
    for path, rule in targets.items():
        k, g = model.get_submodule(path).in_features, rule.weight.granularity
        if isinstance(g, PerGroup) and k % g.group_size:
            raise SSMQError(f"{name}: group size {g.group_size} does not divide in_features {k} of {path}")
        if rule.weight.dtype == "int4" and k % 2:
            raise SSMQError(f"{name}: int4 needs an even in_features, {path} has {k}")
    return targets


def _check_kv(recipe: Recipe, model: nn.Module, name: str) -> None:
    kv = recipe.cache.kv
    if kv is None:
        return
    from ssmq.quant.kvquant import attention_layers

    layers = attention_layers(model)
    if not layers:
        raise SSMQError(f"{name} quantizes the KV cache, and this {model.config.arch} model has no attention layer")
    e = model.layers[layers[0]].mixer.e
    if e % 2:
        raise SSMQError(f"{name}: the KV cache stores two codes per byte, so the head dim must be even, not {e}")
    if (kv.keys.rotate or kv.values.rotate) and e & (e - 1):
        raise SSMQError(f"{name}: the rotated KV format needs a power-of-two head dim, not {e}")


def _check_ssdi8(recipe: Recipe, cfg, name: str) -> None:
    if recipe.has("mean_correction") and not recipe.has("ssdi8"):
        raise SSMQError(f"{name}: mean_correction is fitted against the float model that the ssdi8 transform "
                        "keeps; add ssdi8")
    if not recipe.has("ssdi8"):
        return
    if cfg.ssm_kind == "mamba1":
        raise SSMQError(f"{name}: ssdi8 quantizes the Mamba-2 SSD; this model's SSM layers are Mamba-1")
    if [t.name for t in recipe.transforms if t.name != "mean_correction"][-1] != "ssdi8":
        raise SSMQError(f"{name}: ssdi8 must come after every other transform (they change the float model its "
                        "scales and the mean correction are calibrated on)")
    state, passing = recipe.param("ssdi8", "int8_state"), recipe.param("ssdi8", "int8_passing")
    if passing and not state:
        raise SSMQError(f"{name}: ssdi8 int8_passing needs int8_state")
    if recipe.cache.state_bits == 8 and not state:
        raise SSMQError(f"{name}: an 8-bit state cache with ssdi8 needs int8_state")


# ---------------------------------------------------------------------------------------------
# transforms: name -> fn(model, recipe, transform, calib, kw) -> {layer: x cluster map} or None
# ---------------------------------------------------------------------------------------------
def _smoothquant(model, recipe: Recipe, alpha: float, calib, kw) -> None:
    targets = plan(recipe, model)
    groups = [(prod, readers) for prod, readers in smoothquant_groups(model)
              if all(r in targets and targets[r].act is not None for r in readers)]
    if not groups:
        return
    first = {readers[0]: (prod, readers) for prod, readers in groups}
    hooks, obs = attach_observers(model, list(first), lambda p, m: MinMaxObserver(PerChannel(-1)))
    try:
        run_calibration(model, calib, desc="smoothquant", **kw)
    finally:
        hooks.remove()
    get = model.get_submodule
    for path, (prod, readers) in first.items():
        lo, hi = obs[path].range()
        s = smoothing_scales(torch.maximum(-lo, hi), [get(r).weight for r in readers], alpha)
        apply_smoothing_(s, get(prod), [get(r) for r in readers])


def _ends_stay_float(model: nn.Module, recipe: Recipe) -> bool:
    """Neither the embedding nor lm_head is quantized: a tie between them can be kept (``online_ends``)."""
    return recipe.embedding is None and "lm_head" not in plan(recipe, model)


TRANSFORMS = {
    "smoothquant": lambda model, recipe, t, calib, kw: _smoothquant(model, recipe, float(t.get("alpha")), calib, kw),
    "hadamard": lambda model, recipe, t, calib, kw: rotate_model_(
        model, online=bool(t.get("online")),
        online_ends=bool(t.get("online_ends")) and _ends_stay_float(model, recipe)),
    "hadamard_y": lambda model, recipe, t, calib, kw: hadamard_y_(model),
    "sort_cluster": lambda model, recipe, t, calib, kw: sort_and_cluster_(model, calib, t.get("m"), t.get("n"), **kw),
    "gamma_migration": lambda model, recipe, t, calib, kw: ssdi8.gamma_migration_(model),
    "ssdi8": lambda model, recipe, t, calib, kw: ssdi8.install_ssdi8_(
        model, calib, SSDi8Options(**{k: bool(t.get(k)) for k in ("reformulate", "int8_state", "int8_passing")}),
        batch_size=kw["batch_size"], progress=kw["progress"]) and None,
    # fitted after the linears are quantized (``_quantize``), against the float model kept before ssdi8
    "mean_correction": lambda model, recipe, t, calib, kw: None,
}


# ---------------------------------------------------------------------------------------------
# linears
# ---------------------------------------------------------------------------------------------
def _online(model: nn.Module):
    """Hook transform: the input a module really quantizes (rotated for RotatedLinear)."""
    def transform(path, x):
        return hadamard_transform(x) if isinstance(model.get_submodule(path), RotatedLinear) else x
    return transform


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def _hessian_chunks(model, paths: list[str], budget_bytes: int) -> list[list[str]]:
    chunks, cur, used = [], [], 0
    for p in paths:
        k = model.get_submodule(p).in_features
        if cur and used + 8 * k * k > budget_bytes:
            chunks.append(cur)
            cur, used = [], 0
        cur.append(p)
        used += 8 * k * k
    return chunks + ([cur] if cur else [])


def _quantize_linears(model, targets: dict[str, Rule], calib, kw, budget_bytes: int) -> None:
    from tqdm.auto import tqdm

    static = {p: r for p, r in targets.items() if r.act is not None and r.act.static}
    gptq = [p for p, r in targets.items() if r.weight.method == "gptq"]
    act_scales, qweights = {}, {}
    chunks = _hessian_chunks(model, gptq, budget_bytes) or ([[]] if static else [])
    for ci, chunk in enumerate(chunks):
        hooks, observers = [], {}
        if ci == 0 and static:
            def make(path, m):
                a = static[path].act
                return make_observer(a.observer, PerTensor(), a.dtype, a.symmetric, a.percentile)
            h, observers = attach_observers(model, list(static), make, transform=_online(model))
            hooks.append(h)
        hess = {p: HessianAccumulator(model.get_submodule(p).in_features, device=model.get_submodule(p).weight.device)
                for p in chunk}
        online = _online(model)
        hooks.append(Hooks(model, chunk, lambda p, x: hess[p].add(online(p, x))))
        try:
            run_calibration(model, calib, desc=f"calibration {ci + 1}/{len(chunks)}", **kw)
        finally:
            for h in hooks:
                h.remove()
        for p, ob in observers.items():
            act_scales[p] = ob.qparams(static[p].act.dtype, static[p].act.symmetric)[0]
        for p in tqdm(chunk, desc="gptq", disable=not kw["progress"], unit="layer"):
            qweights[p] = gptq_quantize(model.get_submodule(p).weight, hess.pop(p).H, targets[p].weight)
    for p, rule in targets.items():
        _set(model, p, QuantLinear.from_float(model.get_submodule(p), rule.weight, rule.act, act_scales.get(p),
                                              qweights.get(p)))


def linears_only(recipe) -> bool:
    """Whether ``recipe`` swaps linears for ones quantized from their own weights and does nothing else (no
    calibration, transform, tap, search, embedding, conv or cache format): a block of a model can take it alone."""
    r = get_recipe(recipe)
    return not (r.transforms or r.taps or r.search or r.embedding or r.conv or r.cache.kv or r.cache.state_bits != 16
                or r.needs_calibration())


@torch.no_grad()
def quantize_linears_under(model: nn.Module, recipe, prefix: str) -> None:
    """What ``quantize`` does to the linears at ``prefix`` ("layers.3", "lm_head") and under it, by the linears-only
    ``recipe``; the rest of ``model`` is not read (it may still be on the meta device), and no record is set
    (``quantization_record``)."""
    recipe = get_recipe(recipe)
    if not linears_only(recipe):
        raise SSMQError(f"recipe {recipe.name!r} does more than quantize linears from their weights: use quantize()")
    targets = {p: r for p, r in plan(recipe, model).items() if p == prefix or p.startswith(prefix + ".")}
    _quantize_linears(model, targets, None, {"batch_size": 1, "device": None, "progress": False}, 0)


def quantization_record(recipe: Recipe, calib: CalibrationData | None = None, info: dict | None = None) -> dict:
    """What a quantized model carries as ``model.quantization`` (saved with it): the recipe, the calibration data's
    record, and what the recipe's steps report."""
    return {"recipe": recipe.to_dict(), "calibration": None if calib is None else calib.record(), **(info or {})}


# ---------------------------------------------------------------------------------------------
# the pipeline
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def quantize(model: nn.Module, recipe, calib: CalibrationData | None = None, *, batch_size: int = 8,
             device=None, progress: bool = True, heldout: CalibrationData | None = None,
             hessian_budget_bytes: int = 2 << 30) -> nn.Module:
    """Quantize ``model`` in place by ``recipe`` (a name, a JSON path or a Recipe); returns it.

    calib: calibration windows (``load_calibration()``); recipes that calibrate nothing need none.
    heldout: windows for a search's fitness (default: drawn from calib's source with seed + 1).
    """
    recipe = get_recipe(recipe)
    check(recipe, model)
    if recipe.needs_calibration() and calib is None:
        raise SSMQError(f"recipe {recipe.name!r} needs calibration data (static scales, GPTQ, SmoothQuant or SSM taps)")
    if getattr(model, "quantization", None) is not None:
        raise SSMQError("this model is already quantized; start from the float model")
    kw = {"batch_size": batch_size, "device": device, "progress": progress}
    if recipe.search is None:
        info = _quantize(model, recipe, calib, kw, hessian_budget_bytes)
    else:
        from ssmq.quant.ssm.mixed import search_layers

        other = copy.deepcopy(model)
        for m, r in ((model, replace(recipe, search=None)), (other, recipe.at_16bit_activations())):
            _quantize(m, r, calib, kw, hessian_budget_bytes)
        info = {"mixed": search_layers(model, other, recipe.search, calib, heldout, batch_size)}
    model.quantization = quantization_record(recipe, calib, info)
    # tap quantizers and state tables are built with CPU buffers; a model quantized on a GPU must not keep them
    # there (kernels would copy them host-to-device on every step, which a CUDA-graph capture refuses)
    dev = next(model.parameters()).device
    if any(t.device != dev for t in model.buffers()):
        model.to(dev)
    return model


def _side_attention_check(model, recipe: Recipe) -> None:
    """Transforms, KV formats and the layer search know a block's mixer and feed-forward only: refused for models
    with attention beside their mixers (Zamba2, Falcon-H1), which would be left out or mis-folded."""
    if not model.config.side_attention_layers():
        return
    parts = [f"transforms ({', '.join(t.name for t in recipe.transforms)})" if recipe.transforms else "",
             "a KV cache format" if recipe.cache.kv is not None else "", "a layer search" if recipe.search else ""]
    parts = [p for p in parts if p]
    if parts:
        raise SSMQError(f"recipe {recipe.name}: {' and '.join(parts)} not built for models with attention beside "
                        "their mixers (Zamba2, Falcon-H1); linear-only recipes and int8-state apply")


def _quantize(model, recipe: Recipe, calib, kw, hessian_budget_bytes) -> dict:
    _side_attention_check(model, recipe)
    clusters: dict[int, torch.Tensor] = {}
    reference = None
    if recipe.cache.kv is not None:  # first, on the float model (the Fisher needs gradients through float layers)
        from ssmq.quant.kvquant import calibrate_kv_

        calibrate_kv_(model, recipe.cache.kv, calib.input_ids[:recipe.calibration.kv_windows],
                      min(kw["batch_size"], 4))
    for t in recipe.transforms:
        if t.name == "ssdi8" and recipe.has("mean_correction"):
            reference = copy.deepcopy(model)  # the float model in the same (transformed) basis
        clusters = TRANSFORMS[t.name](model, recipe, t, calib, kw) or clusters
    if recipe.taps:
        from ssmq.quant.ssm.taps import install_tap_quantizers

        install_tap_quantizers(model, recipe.taps, clusters, calib, **kw)
    _quantize_linears(model, plan(recipe, model), calib, kw, hessian_budget_bytes)
    if recipe.conv is not None:  # after the linears: the conv's input scale observes in_proj as it will run
        from ssmq.quant.conv import quantize_convs_

        quantize_convs_(model, recipe.conv, calib, kw)
    if recipe.embedding is not None:
        model.embedding = QuantEmbedding.from_float(model.embedding, recipe.embedding)
    if recipe.has("mean_correction"):
        ssdi8.mean_correction_(model, reference, calib, float(recipe.param("mean_correction", "eta")),
                               kw["batch_size"], kw["progress"])
        del reference
    if recipe.cache.state_bits == 8 and recipe.has("ssdi8"):
        ssdi8.enable_ssdi8_state(model)
    elif recipe.cache.state_bits == 8:
        from ssmq.quant.ssm.state_cache import enable_int8_state

        c = recipe.calibration
        windows = None if calib is None else calib.input_ids[:c.state_windows]  # (dynamic scales: none needed)
        enable_int8_state(model, clusters, windows, c.state_chunk, kw["batch_size"], kw["progress"],
                          layout=recipe.cache.state_scales)
    if not (clusters or recipe.taps or recipe.cache.state_bits == 8):
        return {}
    return {"ssm": {"clusters": {i: int(c.max()) + 1 for i, c in clusters.items()}, "ssm_layers": ssm_layers(model)}}
