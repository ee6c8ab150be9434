"""Passkey retrieval (ssmq.eval.passkey) on CPU: the prompt builder puts the key where it says and at the exact
length, the scorer finds the key only as a whole number, and a trial decodes through a quantized KV cache."""

import pytest
import torch

from _quant_tiny import tiny_calib, tiny_model
from char_tokenizer import ALPHABET, CharTokenizer
from ssmq.errors import SSMQError
from ssmq.eval import passkey as pk
from ssmq.models.quant_kv import QuantKVState
from ssmq.quant import quantize


class DigitCharTokenizer(CharTokenizer):
    """The tests' character tokenizer plus the ten digits (ids 63..72; the tiny models have 256 ids)."""

    SYMBOLS = ALPHABET + "0123456789"

    def encode(self, text):
        return [self.SYMBOLS.index(c) for c in text if c in self.SYMBOLS]

    def decode(self, ids):
        return "".join(self.SYMBOLS[i] if i < len(self.SYMBOLS) else "\ufffd" for i in ids)


TOK = DigitCharTokenizer()


@pytest.mark.parametrize("n,seed,depth", [(400, 0, None), (400, 1, None), (700, 2, 0.0), (700, 3, 1.0),
                                          (1000, 4, 0.5)])
def test_prompt_has_the_key_at_its_depth_and_the_exact_length(n, seed, depth):
    p = pk.build_prompt(TOK, n, seed, depth)
    assert len(p.ids) == n
    assert len(p.key) == 5 and p.key.isdigit()
    assert p.ids[p.key_start:p.key_start + len(p.key_ids)] == p.key_ids
    assert TOK.decode(p.key_ids) == pk.KEY.format(key=p.key)
    text = TOK.decode(p.ids)
    assert text.startswith(pk.INTRO) and text.endswith(pk.QUESTION)
    assert text.count(p.key) == 2  # only the key sentence carries it ("... is KEY. ... KEY is ...")
    n_intro = len(TOK.encode(pk.INTRO))
    n_filler = n - n_intro - len(p.key_ids) - len(TOK.encode(pk.QUESTION))
    assert p.key_start - n_intro == round(p.depth * n_filler)
    if depth is None:
        assert 0.05 <= p.depth <= 0.95
    # a seed fixes the trial
    assert pk.build_prompt(TOK, n, seed, depth) == p


def test_seeds_give_different_keys():
    assert len({pk.build_prompt(TOK, 400, s).key for s in range(8)}) == 8


@pytest.mark.parametrize("text,found", [(" 12345.", True), ("12345", True), ("key: 12345 is", True),
                                        (" 123456", False), (" 1234", False), ("0012345", False),
                                        (" 12 345", False), ("", False)])
def test_scorer_finds_the_key_only_as_a_whole_number(text, found):
    assert pk.passkey_found(text, "12345") is found


def test_bad_input_is_a_clear_error():
    with pytest.raises(SSMQError, match="too short"):
        pk.build_prompt(TOK, 100, 0)
    with pytest.raises(SSMQError, match="depth"):
        pk.build_prompt(TOK, 400, 0, depth=1.5)
    with pytest.raises(SSMQError, match="at least one"):
        pk.run_passkey(tiny_model("hybrid"), TOK, [], [0])


def test_a_model_that_repeats_the_key_succeeds(monkeypatch):
    """The runner scores what generate produced: a stand-in generate that answers the prompt's key succeeds,
    one that answers another number fails."""
    import ssmq.runtime.generate as gen

    def answer(model, prompts, params):
        # the key sentence is "The pass key is KEY. ..."; read KEY back from the prompt
        text = TOK.decode(prompts[0])
        key = text.split("The pass key is ")[1][:5]
        return [TOK.encode(f" {key if model == 'right' else '99999'}.")[:params.max_new_tokens]]

    monkeypatch.setattr(gen, "generate", answer)
    assert all(r["success"] for r in pk.run_passkey("right", TOK, [400, 500], [0, 1]))
    assert not any(r["success"] for r in pk.run_passkey("wrong", TOK, [400], [0, 1]))


def test_trial_decodes_through_the_quantized_kv_cache(monkeypatch):
    """A tiny hybrid with a KVQuant format: the trial's generate allocates a QuantKVState and decodes 4 tokens."""
    m = tiny_model("hybrid")
    quantize(m, "kvquant-nuq3-1%", tiny_calib(4, 32), progress=False)
    seen = []
    alloc = m.allocate_cache
    monkeypatch.setattr(m, "allocate_cache", lambda *a, **k: seen.append(alloc(*a, **k)) or seen[-1])
    rows = []
    out = pk.run_passkey(m, TOK, [300], [0, 1], max_new_tokens=4, on_row=rows.append)
    assert out == rows and len(rows) == 2
    assert isinstance(seen[0].states[1], QuantKVState)
    assert all(isinstance(r["success"], bool) and r["n_tokens"] == 300 for r in rows)
    assert seen[0].seqlens[0] == 300 + 4 - 1  # the prompt and every decoded token but the last went through it
    assert torch.is_tensor(seen[0].seqlens)
