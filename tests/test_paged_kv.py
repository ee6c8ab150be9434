"""The paged KV state (blocks through a block table) against the dense KV state, and the block allocator."""

from __future__ import annotations

import pytest
import torch

from tiny_ssm import tiny_model

from ssmq.runtime.kv_blocks import BlockAllocator


@pytest.mark.parametrize("arch,kv", [("hybrid", None), ("llama", None), ("hybrid", "kvquant-nuq3-1%"),
                                     ("llama", "kvquant-nuq4-1%"), ("hybrid", "kv-turbo3")])
@pytest.mark.parametrize("before_rope", [False, True])
def test_paged_kv_cache_equals_the_dense_one(before_rope, arch, kv):
    """Two sequences prefilled in chunks and decoded, their blocks handed out out of order and interleaved; float
    KV, or quantized (``kv``: a KV format calibrated on the model; its spec says where keys are cached, so
    before_rope is the float cache's alone). The quantized pools hold the dense rows' bytes: same logits, exactly."""
    model = tiny_model(arch, seed=2)
    if kv is not None:
        if before_rope:
            pytest.skip("a quantized cache keeps keys where its spec says")
        from ssmq.quant import quantize
        from ssmq.quant.calibration import CalibrationData

        ids = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
        quantize(model, kv, CalibrationData(ids, "random", 0), progress=False)
    dense = model.allocate_cache(3, 64, kv_keys_before_rope=before_rope)
    paged = model.allocate_cache(3, 64, kv_keys_before_rope=before_rope, kv_blocks=40, kv_block_size=4)
    alloc = BlockAllocator(40, 4)
    alloc._free.reverse()  # hand out high block ids first: no accidental identity layout
    g = torch.Generator().manual_seed(0)
    prompts = {0: torch.randint(0, 64, (1, 13), generator=g), 2: torch.randint(0, 64, (1, 7), generator=g)}
    for slot in prompts:
        alloc.admit(slot, 40)
    with torch.inference_mode():
        outs = []
        def take(s, n):
            paged.block_table.assign(s, *alloc.grow(s, n))

        for cache, grow in ((dense, lambda s, n: None), (paged, take)):
            got = []
            for slot, ids in prompts.items():
                for a in range(0, ids.shape[1], 5):
                    chunk = ids[:, a:a + 5]
                    grow(slot, a + chunk.shape[1])
                    got.append(model(chunk, cache, slots=[slot]))
            tokens = torch.tensor([3, 5])
            slots = torch.tensor(list(prompts))
            for t in range(9):
                for s in prompts:
                    grow(s, int(cache.seqlens[s]) + 1)
                got.append(model.step(tokens, cache, slots))
                tokens = got[-1].argmax(-1)
            outs.append(got)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if kv is not None:
        assert type(paged.states[1]).__name__ == "QuantKVState" and paged.states[1].table is paged.block_table
    assert alloc.used == alloc.blocks_for(13 + 9) + alloc.blocks_for(7 + 9)


def test_block_allocator_reserves_at_admission_and_frees_on_release():
    alloc = BlockAllocator(11, 4)  # 10 usable blocks (block 0 is the null block)
    assert alloc.can_admit(40) and not alloc.can_admit(41)
    alloc.admit(0, 24)  # 6 blocks promised
    assert not alloc.can_admit(17) and alloc.can_admit(16)
    assert alloc.grow(0, 5) == (0, alloc._owned[0][:2]) and alloc.used == 2
    assert alloc.grow(0, 8) == (2, [])
    with pytest.raises(RuntimeError):
        alloc.grow(0, 25)
    alloc.release(0)
    assert alloc.used == 0 and alloc.can_admit(40)
    assert 0 not in alloc._free  # the null block is never handed out


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["hybrid", "llama"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float_cache_decode_through_the_kernel_equals_the_reference(paged, arch, dtype, monkeypatch):
    """A float16 / bfloat16 KV cache, dense or paged (blocks out of order), decodes through the flash-decoding
    kernel (``KVState.decode`` / ``PagedKVState.decode``): ragged rows (prefilled to 11 and 6 tokens), teacher-forced,
    give the logits of the decode through the prefix read (+ ``kernels.prefill_attention``: attention_ref on CPU, the
    prefill kernel on CUDA, itself tested against attention_ref). On CUDA the model runs in the cache's
    dtype; on CPU under the interpreter in float32 over a float16 cache, the kernel taking it as on CUDA."""
    from test_kernels import DEV

    if DEV == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter computes through numpy, which has no bfloat16")

    import ssmq.models.paged_kv as paged_kv
    import ssmq.models.state as state
    from ssmq.kernels import kv_decode_fast

    model = tiny_model(arch, seed=3).to(DEV, dtype if DEV == "cuda" else torch.float32)
    if DEV == "cpu":  # the kernel the dispatch picks on CUDA (head dim 32), not its CPU reference; the eligibility too
        monkeypatch.setattr(state.kernels, "float_kv_decode",
                            lambda *a, kernel, **kw: kv_decode_fast.float_kv_decode(*a, **kw))
        eligible = lambda k, rope, cuda=None: rope is None and k.dtype == torch.float16  # noqa: E731
        monkeypatch.setattr(state, "kernel_decodes", eligible)
        monkeypatch.setattr(paged_kv, "kernel_decodes", eligible)
    g = torch.Generator().manual_seed(1)
    prompts = {0: torch.randint(0, 64, (1, 11), generator=g), 2: torch.randint(0, 64, (1, 6), generator=g)}
    steps = torch.randint(0, 64, (6, 2), generator=g).to(DEV)
    ran = []
    kind = paged_kv.PagedKVState if paged else state.KVState
    real = kind.decode

    def run(use_kernel: bool):
        monkeypatch.setattr(kind, "decode", (lambda self, *a: ran.append(real(self, *a)) or ran[-1]) if use_kernel
                            else (lambda self, *a: None))
        kw = dict(kv_blocks=40, kv_block_size=4) if paged else {}
        cache = model.allocate_cache(3, 64, dtype=dtype, **kw)
        if paged:
            alloc = BlockAllocator(40, 4)
            alloc._free.reverse()
            for s in prompts:
                alloc.admit(s, 40)
                cache.block_table.assign(s, *alloc.grow(s, 30))
        with torch.inference_mode():
            for s, ids in prompts.items():
                model(ids.to(DEV), cache, slots=[s])
            slots = torch.tensor(list(prompts), device=DEV)
            return torch.stack([model.step(tokens, cache, slots).float() for tokens in steps])

    ref = run(False)
    got = run(True)
    assert ran and all(o is not None for o in ran), "the decode did not go through the kernel"
    # a float16 model on CUDA: 5e-3 (the H100 run of 2026-11-28); bfloat16 keeps 8 bits of mantissa: 3e-2;
    # float32 on CPU: 2e-3
    bound = 2e-3 if DEV == "cpu" else 5e-3 if dtype == torch.float16 else 3e-2
    assert ((got - ref).norm() / ref.norm()).item() < bound
