"""Every offline SSM transform leaves the float function of a tiny random model unchanged (float32)."""

import copy

import pytest
import torch

from ssmq.quant.ssm.cluster import cluster_heads, kmeans_1d
from ssmq.quant.ssm.permute import permutable_block, permute_mamba1_, permute_mamba2_
from tiny_ssm import synthetic_calibration, tiny_model
from ssmq.quant.rotation import rotate_model_ as hadamard_both_  # Quamba2 both-sides: QuaRot, online H on y
from ssmq.quant.ssm.transforms import hadamard_y_, sort_and_cluster_

IDS = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))


def logits(model):
    with torch.no_grad():
        return model(IDS)


def assert_same(a, b, tol=1e-5):
    assert (a - b).abs().max() <= tol * a.abs().max(), (a - b).abs().max() / a.abs().max()


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_random_channel_permutation_preserves_function(arch):
    model = tiny_model(arch)
    ref = logits(model)
    cfg = model.config
    g = torch.Generator().manual_seed(3)
    for layer in model.layers:
        if arch == "mamba1":
            permute_mamba1_(layer.mixer, torch.randperm(cfg.d_inner, generator=g))
        else:
            h, p, blk = cfg.nheads, cfg.headdim, permutable_block(cfg)
            head_perm = torch.cat([b * blk + torch.randperm(blk, generator=g) for b in range(h // blk)])
            perm = torch.cat([hh * p + torch.randperm(p, generator=g) for hh in head_perm.tolist()])
            permute_mamba2_(layer.mixer, perm, head_perm)
    assert_same(ref, logits(model))


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_sort_and_cluster_preserves_function_and_makes_contiguous_groups(arch):
    model = tiny_model(arch)
    ref = logits(model)
    clusters = sort_and_cluster_(model, synthetic_calibration(64, 4, 16), m=4, n=4, progress=False)
    assert_same(ref, logits(model))
    cfg = model.config
    for index in clusters.values():
        assert index.shape == (cfg.d_inner,) and int(index.max()) + 1 <= 16
        if arch == "mamba1":  # channels sorted: each group is one contiguous run
            assert (index[1:] >= index[:-1]).all()
        else:  # inside every head, channel groups are contiguous runs
            per_head = index.reshape(cfg.nheads, cfg.headdim)
            assert (per_head[:, 1:] >= per_head[:, :-1]).all()


def test_cluster_heads_respects_blocks_and_groups_similar_heads():
    h, p = 8, 4
    cmax = torch.ones(h, p)
    cmax[[1, 6]] *= 100  # two outlier heads
    perm, index, head_perm = cluster_heads(cmax.reshape(-1), h, p, m=2, n=2, block=4)
    assert sorted(head_perm[:4].tolist()) == [0, 1, 2, 3] and sorted(head_perm[4:].tolist()) == [4, 5, 6, 7]
    outlier_groups = set(index.reshape(h, p)[(head_perm == 1) | (head_perm == 6)].flatten().tolist())
    normal_groups = set(index.reshape(h, p)[(head_perm != 1) & (head_perm != 6)].flatten().tolist())
    assert not outlier_groups & normal_groups


def test_kmeans_1d_orders_clusters():
    ids = kmeans_1d(torch.tensor([0.0, 0.1, 5.0, 5.1, 10.0, 0.05]), 3)
    assert ids.tolist() == [0, 0, 1, 1, 2, 0]


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
@pytest.mark.parametrize("transform", [hadamard_y_, hadamard_both_])
def test_hadamard_fusions_preserve_function(arch, transform):
    model = tiny_model(arch)
    ref = logits(model)
    transform(model)
    # float32 rotations of the weights: a few ulps relative to the largest logit (1.1e-5 seen)
    assert_same(ref, logits(model), tol=5e-5)


def test_all_transforms_compose():
    model = tiny_model("mamba2")
    ref = logits(copy.deepcopy(model))
    sort_and_cluster_(model, synthetic_calibration(64, 4, 16), progress=False)
    hadamard_both_(model)
    assert_same(ref, logits(model))
