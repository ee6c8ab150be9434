"""``quantize(model, recipe, calib)``: apply a recipe to a float SSMLM, in place.

Order: refuse what does not apply (``check_recipe``), before any work -> transforms in recipe order
(smoothquant calibrates its own activation maxima) -> one calibration pass per chunk of GPTQ
Hessians (static activation observers ride along the first) -> swap each targeted nn.Linear for a
``QuantLinear``. Activations and Hessians are observed on the float (transformed) model, and the
input of a ``RotatedLinear`` is observed after its online rotation, i.e. as the QuantLinear sees it.
The result carries ``model.quantization`` = {"recipe": ..., "calibration": ...} for the checkpoint.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq.errors import SSMQError
from ssmq.quant.calibration import CalibrationData, Hooks, attach_observers, run_calibration
from ssmq.quant.gptq import HessianAccumulator, gptq_quantize
from ssmq.quant.hadamard import RotatedLinear, hadamard_transform
from ssmq.quant.linear import QuantLinear
from ssmq.quant.observers import MinMaxObserver, make_observer
from ssmq.quant.primitives import PerChannel, PerTensor
from ssmq.quant.recipe import Recipe, check_recipe, get_recipe, plan
from ssmq.quant.rotation import rotate_model_
from ssmq.quant.smoothquant import apply_smoothing_, smoothing_scales, smoothquant_groups


def _online(model: nn.Module):
    """Hook transform: the input a module really quantizes (rotated for RotatedLinear)."""
    def transform(path, x):
        return hadamard_transform(x) if isinstance(model.get_submodule(path), RotatedLinear) else x
    return transform


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


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


def check_any_recipe(recipe, model: nn.Module) -> None:
    """Refuse a recipe (of either kind) that does not apply to ``model``, before any work."""
    from ssmq.quant.ssm.api import check_ssm_recipe

    recipe = get_recipe(recipe)
    if isinstance(recipe, Recipe):
        check_recipe(recipe, model)
    else:
        check_ssm_recipe(recipe, model)


def needs_calibration(recipe) -> bool:
    recipe = get_recipe(recipe)
    return recipe.needs_calibration() if isinstance(recipe, Recipe) else True


@torch.no_grad()
def quantize(model: nn.Module, recipe, calib: CalibrationData | None = None, *, batch_size: int = 8,
             device=None, progress: bool = True, hessian_budget_bytes: int = 2 << 30) -> nn.Module:
    """Quantize ``model`` in place by ``recipe`` (a name, a JSON path or a Recipe); returns it.

    calib: windows for recipes with static activation scales, GPTQ or SmoothQuant
    (``load_calibration()``); recipes without any of those need none. SSM recipes
    (``quamba-*``, ``quamba2-*``) go to ``ssmq.quant.ssm.quantize_ssm``.
    """
    from tqdm.auto import tqdm

    recipe = get_recipe(recipe)
    if not isinstance(recipe, Recipe):
        from ssmq.quant.ssm.api import quantize_ssm

        if calib is None:
            raise SSMQError(f"recipe {recipe.name!r} needs calibration data")
        return quantize_ssm(model, recipe, calib, batch_size=batch_size, progress=progress)
    check_recipe(recipe, model)
    if recipe.needs_calibration() and calib is None:
        raise SSMQError(f"recipe {recipe.name!r} needs calibration data (static scales, GPTQ or SmoothQuant)")
    if getattr(model, "quantization", None) is not None:
        raise SSMQError("this model is already quantized; start from the float model")
    kw = {"batch_size": batch_size, "device": device, "progress": progress}

    for t in recipe.transforms:
        if t.name == "smoothquant":
            _smoothquant(model, recipe, float(t.get("alpha")), calib, kw)
        elif t.name == "hadamard":
            rotate_model_(model, online=bool(t.get("online")))

    targets = plan(recipe, model)
    static = {p: r for p, r in targets.items() if r.act is not None and r.act.static}
    gptq = [p for p, r in targets.items() if r.weight.method == "gptq"]
    act_scales, qweights = {}, {}
    chunks = _hessian_chunks(model, gptq, hessian_budget_bytes) or ([[]] if static else [])
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
        for p in tqdm(chunk, desc="gptq", disable=not progress, unit="layer"):
            qweights[p] = gptq_quantize(model.get_submodule(p).weight, hess.pop(p).H, targets[p].weight)

    for p, rule in targets.items():
        lin = model.get_submodule(p)
        _set(model, p, QuantLinear.from_float(lin, rule.weight, rule.act, act_scales.get(p), qweights.get(p)))
    model.quantization = {"recipe": recipe.to_dict(), "calibration": None if calib is None else calib.record()}
    return model
