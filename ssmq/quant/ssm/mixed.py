"""W4AX mixed precision (Quamba2): each Mamba layer runs W4A8 or W4A16, chosen by evolutionary search.

Glossary: L layers, a genome is a tuple of L genes (1 = A8, 0 = A16) with a fixed number of A16 layers
(A8:A16 = 3:1 by default, rounded to the nearest count).

Both variants are quantized once by ``ssmq.quant.api.quantize`` (the recipe, and the recipe at 16-bit
activations: same transforms, so the residual stream and the channel order agree layer by layer); a genome is evaluated by plugging each variant's layers
into one model and measuring perplexity on held-out calibration windows (the fitness, lower is better).
Search (defaults of the paper): population 40 random genomes, 5 generations; each generation keeps the
better half and adds 10 mutations (one A8 and one A16 layer swap precision) and 10 crossovers (uniform,
repaired to the A16 count) of the kept ones. Genomes are evaluated once (memoised); when fewer distinct
genomes exist than the population (8 layers, 2 A16: 28), the search is exhaustive in effect.
Baselines: HC-first (A16 on the first layers) and HC-last (on the last layers).
"""

from __future__ import annotations

import math
import random
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Genome = tuple[int, ...]


def a16_count(n_layers: int, ratio) -> int:
    a8, a16 = ratio
    return int(round(n_layers * a16 / (a8 + a16)))


def hc_first(n_layers: int, k: int) -> Genome:
    return tuple(0 if i < k else 1 for i in range(n_layers))


def hc_last(n_layers: int, k: int) -> Genome:
    return tuple(0 if i >= n_layers - k else 1 for i in range(n_layers))


def _random(rng: random.Random, n: int, k: int) -> Genome:
    low = set(rng.sample(range(n), k))
    return tuple(0 if i in low else 1 for i in range(n))


def _mutate(rng: random.Random, g: Genome) -> Genome:
    ones, zeros = [i for i, v in enumerate(g) if v], [i for i, v in enumerate(g) if not v]
    if not ones or not zeros:
        return g
    out = list(g)
    i, j = rng.choice(ones), rng.choice(zeros)
    out[i], out[j] = 0, 1
    return tuple(out)


def _crossover(rng: random.Random, a: Genome, b: Genome, k: int) -> Genome:
    child = [rng.choice((x, y)) for x, y in zip(a, b)]
    while child.count(0) > k:  # repair to exactly k A16 layers
        child[rng.choice([i for i, v in enumerate(child) if v == 0])] = 1
    while child.count(0) < k:
        child[rng.choice([i for i, v in enumerate(child) if v == 1])] = 0
    return tuple(child)


def evolutionary_search(n_layers: int, k: int, fitness: Callable[[Genome], float], population: int = 40,
                        generations: int = 5, mutations: int = 10, crossovers: int = 10, seed: int = 0) -> dict:
    """Minimise fitness over genomes with k A16 genes; returns {"best", "fitness", "history", "evaluated"}."""
    rng = random.Random(seed)
    cache: dict[Genome, float] = {}

    def fit(g: Genome) -> float:
        if g not in cache:
            cache[g] = float(fitness(g))
        return cache[g]

    distinct = math.comb(n_layers, k)
    pop: list[Genome] = []
    while len(pop) < min(population, distinct):
        g = _random(rng, n_layers, k)
        if g not in pop:
            pop.append(g)
    history = []
    for _ in range(generations):
        kept = sorted(pop, key=fit)[:max(1, len(pop) // 2)]
        children = [_mutate(rng, rng.choice(kept)) for _ in range(mutations)]
        for _ in range(crossovers):
            a, b = (rng.sample(kept, 2) if len(kept) > 1 else (kept[0], kept[0]))
            children.append(_crossover(rng, a, b, k))
        pop = list(dict.fromkeys(kept + children))  # dedupe, order kept
        history.append(min(fit(g) for g in pop))
    best = min(cache, key=cache.get)
    return {"best": best, "fitness": cache[best], "history": history, "evaluated": len(cache)}


@torch.no_grad()
def window_ppl(model: nn.Module, windows: torch.Tensor, batch_size: int = 8) -> float:
    """exp(mean next-token NLL) over windows (N, l)."""
    dev = next(model.parameters()).device
    nll, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        x = windows[i:i + batch_size].to(dev)
        logits = model(x).float()
        nll += F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                               reduction="sum").item()
        count += x[:, 1:].numel()
    return math.exp(nll / count)


class LayerSwitch:
    """Plugs the layers of two quantized variants of one model into the first one by a genome."""

    def __init__(self, host: nn.Module, other: nn.Module):
        self.host, self.a8_layers, self.a16_layers = host, list(host.layers), list(other.layers)

    def apply(self, genome: Genome) -> nn.Module:
        self.host.layers = nn.ModuleList(a if g else b for g, a, b in zip(genome, self.a8_layers, self.a16_layers))
        return self.host


def _heldout(calib, search, heldout):
    if heldout is not None:
        return heldout.input_ids
    from ssmq.quant.calibration import load_calibration

    n, l = search.heldout_windows, search.heldout_seqlen
    try:
        return load_calibration(calib.source, n, l, seed=calib.seed + 1).input_ids
    except Exception:  # a synthetic calibration set (tests): hold out its last windows instead
        return calib.input_ids[-n:]


@torch.no_grad()
def search_layers(model: nn.Module, other: nn.Module, search, calib, heldout=None, batch_size: int = 8) -> dict:
    """Plug into ``model`` (quantized at A8) the layers of ``other`` (the same recipe at A16) that the search
    picks (``search``: a ``ssmq.quant.recipe.Search``); returns what was searched and found."""
    windows = _heldout(calib, search, heldout)
    switch = LayerSwitch(model, other)
    n = model.config.n_layer
    k = a16_count(n, search.a8_to_a16)

    def fitness(g: Genome) -> float:
        return window_ppl(switch.apply(g), windows, batch_size)

    result = evolutionary_search(n, k, fitness, search.population, search.generations, search.mutations,
                                 search.crossovers, search.seed)
    baselines = {"hc_first": fitness(hc_first(n, k)), "hc_last": fitness(hc_last(n, k)),
                 "all_a8": fitness(tuple([1] * n))}
    switch.apply(result["best"])
    return {"assignment": ["A8" if g else "A16" for g in result["best"]], "fitness_ppl": result["fitness"],
            "history": result["history"], "evaluated": result["evaluated"], "baselines_ppl": baselines,
            "heldout_windows": list(windows.shape)}
