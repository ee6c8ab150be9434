"""Generation: greedy equals transformers on the trained reference models; sampling controls; batching; EOS."""

from __future__ import annotations

import pytest
import torch
from conftest import shared_or_skip
from hf_tiny import save_tiny

import ssmq
from ssmq.errors import SSMQError
from ssmq.runtime.generate import generate, stream_generate
from ssmq.runtime.sampling import SamplingParams, sample_next


@pytest.mark.parametrize("name", ["mamba1", "mamba2", "hybrid"])
def test_greedy_32_tokens_match_transformers_on_reference_model(name):
    from transformers import AutoModelForCausalLM

    folder = shared_or_skip("models", name)
    text = shared_or_skip("data", "eval", "wikitext2", "test.txt").read_text()
    tok = ssmq.load_tokenizer(folder)
    prompt = tok.encode(text[:3000])[:48]
    ours = generate(ssmq.load_model(folder), [prompt], SamplingParams(max_new_tokens=32, stop_at_eos=False))[0]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, len(prompt):]
    assert ours == ref.tolist()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gen")
    save_tiny("hybrid", folder)
    return ssmq.load_model(folder)


def test_batch_of_different_lengths_equals_one_by_one(tiny_model):
    prompts = [[5, 7, 9, 11, 3], [2], [8, 8, 1, 4, 60, 61, 62, 63, 2]]
    params = SamplingParams(max_new_tokens=6, stop_at_eos=False)
    batched = generate(tiny_model, prompts, params)
    single = [generate(tiny_model, [p], params)[0] for p in prompts]
    assert batched == single
    assert all(len(o) == 6 for o in batched)


def test_eos_stops_only_its_row(tiny_model):
    prompts = [[5, 7, 9], [2, 3]]
    free = generate(tiny_model, prompts, SamplingParams(max_new_tokens=8, stop_at_eos=False))
    eos = free[0][2]  # make row 0's third token the end of text
    out = generate(tiny_model, prompts, SamplingParams(max_new_tokens=8, eos_id=eos))
    assert out[0] == free[0][:3]
    cut = free[1].index(eos) + 1 if eos in free[1] else 8
    assert out[1] == free[1][:cut]


def test_streaming_yields_tokens_in_order(tiny_model):
    events = list(stream_generate(tiny_model, [[1, 2], [3]], SamplingParams(max_new_tokens=3, stop_at_eos=False)))
    assert [r for r, _ in events] == [0, 1, 0, 1, 0, 1]


def test_sampling_is_seeded_and_filters_work(tiny_model):
    p = SamplingParams(max_new_tokens=10, temperature=1.5, seed=123, stop_at_eos=False)
    a, b = generate(tiny_model, [[1, 2, 3]], p), generate(tiny_model, [[1, 2, 3]], p)
    assert a == b
    greedy = generate(tiny_model, [[1, 2, 3]], SamplingParams(max_new_tokens=10, stop_at_eos=False))
    for filt in (dict(top_k=1), dict(top_p=1e-6)):
        out = generate(tiny_model, [[1, 2, 3]], SamplingParams(max_new_tokens=10, temperature=2.0, seed=1,
                                                               stop_at_eos=False, **filt))
        assert out == greedy


def test_top_p_keeps_the_nucleus_only():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {int(sample_next(logits, SamplingParams(temperature=1.0, top_p=0.75), torch.Generator().manual_seed(s)))
            for s in range(200)}
    assert seen == {0, 1}
    masked = sample_next(torch.tensor([[0.0, 0.0, 9.0]]), SamplingParams(vocab_limit=2))
    assert masked.item() in (0, 1)


def test_bad_sampling_parameters():
    for bad in (dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2)):
        with pytest.raises(SSMQError):
            SamplingParams(**bad)


def test_empty_prompt_is_refused(tiny_model):
    with pytest.raises(SSMQError, match="at least one token"):
        generate(tiny_model, [[]], SamplingParams())


def test_generation_from_a_quantized_checkpoint_with_quantized_embedding(tmp_path):
    from ssmq.quant import save_quantized
    from ssmq.quant.linear import QuantEmbedding
    from tiny_ssm import synthetic_calibration, tiny_model

    model = tiny_model("mamba2")
    ssmq.quantize(model, "quamba2-w8a8", synthetic_calibration(model.config.vocab_size))
    assert isinstance(model.embedding, QuantEmbedding)  # head-to-toe: no .weight to read the device from
    save_quantized(model, tmp_path / "q")
    loaded = ssmq.load_model(tmp_path / "q")
    params = SamplingParams(max_new_tokens=5, stop_at_eos=False)
    assert generate(loaded, [[1, 2, 3]], params) == generate(model, [[1, 2, 3]], params)


def test_the_next_step_is_launched_before_a_token_is_handed_out(tiny_model):
    """The caller's work on token n overlaps step n + 1: when a token arrives, the step after it has been called
    (but none beyond it), and a row that ends is left out of the steps after the one in flight."""
    calls: list[list[int]] = []
    cache = tiny_model.allocate_cache(2, 32)

    def step(tokens, slots):
        calls.append(slots.tolist())
        return tiny_model.step(tokens, cache, slots)

    prompts = [[5, 7, 9], [2, 4]]
    first = generate(tiny_model, prompts, SamplingParams(max_new_tokens=5, stop_at_eos=False))
    eos = first[0][1]  # row 0 ends at its second token (unless row 1 makes it earlier)
    params = SamplingParams(max_new_tokens=5, eos_id=eos)
    seen = []
    for row, tok in stream_generate(tiny_model, prompts, params, cache=cache, decode_fn=step):
        seen.append((row, tok, len(calls)))
    want = [[t for t in out[:out.index(eos) + 1]] if eos in out else out for out in first]
    got = [[t for r, t, _ in seen if r == row] for row in (0, 1)]
    assert got == want
    # tokens of step n (n = 1 is the prefill's) arrive after n calls: step n + 1 already launched
    steps = {}
    for r, t, n in seen:
        steps.setdefault(n, []).append(r)
    assert sorted(steps) == list(range(1, len(steps) + 1))
    ended = len(want[0])  # row 0's tokens arrive through step `ended`; the step after it still computed row 0
    assert all(0 not in c for c in calls[ended:]) and 0 in calls[ended - 1]


def test_non_finite_logits_fail_the_generation_with_a_clear_error(tiny_model):
    """Logits that turn NaN at the second step: the error names the prompt, and no step ever sees a token id of -1
    (the step after the bad one is already launched when its token is read back)."""
    calls = []

    def step(tokens, slots):
        calls.append(tokens.tolist())
        logits = tiny_model.step(tokens, cache, slots)
        return logits.fill_(float("nan")) if len(calls) == 2 else logits

    cache = tiny_model.allocate_cache(1, 32)
    got = []
    with pytest.raises(SSMQError, match="not finite"):
        for _, tok in stream_generate(tiny_model, [[5, 7]], SamplingParams(max_new_tokens=8, stop_at_eos=False),
                                      cache=cache, decode_fn=step):
            got.append(tok)
    assert len(got) == 2 and all(t >= 0 for c in calls for t in c)
