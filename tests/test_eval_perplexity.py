"""Perplexity equals exp(mean NLL) computed independently, with the window setting reported."""

import math

import pytest
import torch

from ssmq.errors import SSMQError
from ssmq.eval.perplexity import (decode_perplexity_of_ids, perplexity_of_file, perplexity_of_ids, windows,
                                  wikitext2_path)
from toy_lm import ToyLM
from ssmq.paths import shared_path


class ByteTokenizer:
    eos_id = 0

    def encode(self, s):
        return list(s.encode("utf-8"))


def independent_ppl(model, ids, seqlen):
    """Token by token: -log p(x_t | x_<t) with the softmax written out, windows of seqlen, tail dropped."""
    nll, n = 0.0, 0
    for w in range(len(ids) // seqlen):
        x = torch.tensor(ids[w * seqlen:(w + 1) * seqlen])
        with torch.no_grad():
            logits = model(x[None])[0].double()
        for t in range(1, seqlen):
            z = logits[t - 1]
            nll += (torch.log(torch.exp(z - z.max()).sum()) + z.max() - z[x[t]]).item()
            n += 1
    return math.exp(nll / n), n


def test_perplexity_equals_exp_mean_nll():
    torch.manual_seed(0)
    model = ToyLM(vocab_size=97, d=8).eval()
    ids = torch.randint(0, 97, (1000,)).tolist()
    expected, n = independent_ppl(model, ids, 64)
    for bs in (1, 5, 64):
        r = perplexity_of_ids(model, ids, seqlen=64, batch_size=bs, progress=False)
        assert r["ppl"] == pytest.approx(expected, rel=1e-5)
        assert (r["seqlen"], r["n_windows"], r["n_tokens_text"], r["n_tokens_predicted"]) == (64, 15, 1000, n)
    per = perplexity_of_ids(model, ids, seqlen=64, batch_size=5, progress=False, per_window=True)["window_nll"]
    assert len(per) == 15 and math.exp(sum(per) / n) == pytest.approx(expected, rel=1e-5)
    # each window on its own: its NLL does not depend on the batch it ran in
    alone = perplexity_of_ids(model, ids[64 * 3:64 * 4], seqlen=64, progress=False, per_window=True)
    assert alone["window_nll"][0] == pytest.approx(per[3], rel=1e-5)


def test_decode_perplexity_equals_the_forward_one():
    # through model.step over a cache, teacher-forced (and after a prefill through the cache): the same NLL as one
    # forward over each window, on a tiny Mamba-2 in float32
    from tiny_ssm import tiny_model

    model = tiny_model("mamba2")
    ids = torch.randint(0, model.config.vocab_size, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    full = perplexity_of_ids(model, ids, seqlen=40, limit=3, progress=False, per_window=True)
    dec = decode_perplexity_of_ids(model, ids, seqlen=40, limit=3, progress=False)
    assert dec["n_tokens_predicted"] == full["n_tokens_predicted"] == 3 * 39
    assert dec["window_nll"] == pytest.approx(full["window_nll"], rel=1e-5)
    ckpt = decode_perplexity_of_ids(model, ids, seqlen=40, limit=3, progress=False, state_checkpoint=4)
    assert ckpt["window_nll"] == pytest.approx(full["window_nll"], rel=1e-5)  # ReplaySSM: the same states
    pre = decode_perplexity_of_ids(model, ids, seqlen=40, limit=3, prefill=16, progress=False)
    w = windows(ids, 40, 3)
    with torch.no_grad():  # the forward's NLL of tokens 16..39 (predicted from positions 15..38)
        want = torch.nn.functional.cross_entropy(model(w)[:, 15:-1].transpose(1, 2), w[:, 16:], reduction="none")
    assert pre["n_tokens_predicted"] == 3 * 24
    assert pre["window_nll"] == pytest.approx(want.sum(1).tolist(), rel=1e-5)
    with pytest.raises(SSMQError):
        decode_perplexity_of_ids(model, ids, seqlen=40, limit=3, prefill=39, progress=False)


def test_windows_limit_and_short_text():
    ids = list(range(10))
    assert windows(ids, 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]  # tail [8, 9] dropped
    assert windows(ids, 4, limit=1).tolist() == [[0, 1, 2, 3]]
    assert windows(ids, 64).shape == (1, 10)  # shorter than one window: one short window
    with pytest.raises(SSMQError):
        windows([1], 4)
    with pytest.raises(SSMQError):
        windows(ids, 1)


def test_text_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("hello world, " * 40, encoding="utf-8")
    model = ToyLM(vocab_size=256, d=8).eval()
    r = perplexity_of_file(model, ByteTokenizer(), path, seqlen=100, batch_size=2, progress=False)
    assert (r["n_tokens_text"], r["n_windows"], r["n_tokens_predicted"]) == (520, 5, 495)
    assert r["ppl"] == pytest.approx(independent_ppl(model, ByteTokenizer().encode(path.read_text()), 100)[0], rel=1e-5)
    with pytest.raises(SSMQError, match="not found"):
        perplexity_of_file(model, ByteTokenizer(), tmp_path / "missing.txt")


@pytest.mark.skipif(shared_path("data", "eval", "wikitext2") is None, reason="../shared/data/eval/wikitext2 absent")
def test_wikitext2_tokens_and_windows():
    from ssmq.tokenizer import load_tokenizer

    r = perplexity_of_file(ToyLM().eval(), load_tokenizer(), wikitext2_path(), seqlen=2048, limit=1, progress=False)
    assert r["n_tokens_text"] == 295232  # GPT-NeoX tokens of the whole test.txt, read verbatim
    assert (r["n_windows"], r["n_tokens_predicted"]) == (1, 2047)
    assert math.isfinite(r["ppl"])
