"""The loglikelihood scorer against an independent computation, and the multiple-choice scorer on known answers."""

import math

import pytest
import torch

from ssmq.errors import SSMQError
from ssmq.eval.scoring import choice_metrics, encode_pair, loglikelihood, loglikelihood_tokens, mean_stderr
from toy_lm import BigramLM, ToyLM


class ByteTokenizer:
    eos_id = 0

    def encode(self, s):
        return list(s.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


class WordTokenizer:
    """One id per word with its leading space (re ``\\s?\\S+``), assigned on first sight."""

    eos_id = 0

    def __init__(self):
        self.vocab = {"<eos>": 0}

    def encode(self, s):
        import re

        return [self.vocab.setdefault(w, len(self.vocab)) for w in re.findall(r"\s?\S+", s)]


def independent_ll(model, ctx, cont):
    x = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(x)[0].double(), -1)
    ll = sum(logp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont))
    greedy = all(int(logp[len(ctx) - 1 + j].argmax()) == t for j, t in enumerate(cont))
    return ll, greedy


def test_loglikelihood_matches_independent_and_is_batch_invariant():
    torch.manual_seed(0)
    model = ToyLM(vocab_size=50, d=8).eval()
    reqs = []
    for n_ctx, n_cont in [(5, 1), (5, 1), (12, 3), (1, 7), (30, 2), (3, 3)]:
        reqs.append((torch.randint(0, 50, (n_ctx,)).tolist(), torch.randint(0, 50, (n_cont,)).tolist()))
    reqs.append((reqs[0][0], [7]))  # same input as request 0 (one-token continuations): shares its row
    expected = [independent_ll(model, c, x) for c, x in reqs]
    for bs in (1, 3, 16):
        got = loglikelihood_tokens(model, reqs, batch_size=bs, progress=False)
        for (ll, g), (ell, eg) in zip(got, expected):
            assert ll == pytest.approx(ell, abs=1e-4) and g == eg


def test_left_truncation_to_max_length():
    model = ToyLM(vocab_size=50, d=8).eval()
    ctx, cont = list(range(1, 21)), [3, 4]
    (ll, _), = loglikelihood_tokens(model, [(ctx, cont)], max_length=8, progress=False)
    whole = (ctx + cont)[-9:]  # lm-eval: (context + continuation)[-(max_length + 1):][:-1] is the input
    assert ll == pytest.approx(independent_ll(model, whole[:-2], whole[-2:])[0], abs=1e-4)
    with pytest.raises(SSMQError):
        loglikelihood_tokens(model, [(ctx, list(range(10)))], max_length=8, progress=False)


def test_encode_pair_moves_trailing_space_and_uses_prefix_for_empty_context():
    tok = ByteTokenizer()
    assert encode_pair(tok.encode, "ab ", "c", 0) == ([97, 98], [32, 99])
    assert encode_pair(tok.encode, "", "c", 0) == ([0], [99])
    assert encode_pair(tok.encode, "", "\x00c", 0) == ([0], [99])  # continuation already starts with the prefix id


def test_multiple_choice_picks_the_favoured_answer():
    tok = WordTokenizer()
    items = [("The sky is", [" blue", " green", " loud"], 0), ("Two plus two makes", [" five", " four"], 1),
             ("Cats chase", [" clouds", " mice", " trains", " numbers"], 1)]
    model = BigramLM(vocab_size=64)
    for ctx, choices, gold in items:
        model.favour(tok.encode(ctx + choices[gold]))
    for ctx, choices, gold in items:
        res = loglikelihood(model, tok, [(ctx, c) for c in choices], progress=False)
        m = choice_metrics([ll for ll, _ in res], choices, gold)
        assert m["acc"] == 1.0 and m["acc_norm"] == 1.0
        assert res[gold][1] is True  # greedy decoding reproduces the favoured continuation


def test_acc_norm_divides_by_character_length_of_the_choice():
    # the long choice has the higher total loglikelihood per character but the lower total
    m = choice_metrics([-4.0, -6.0], ["ab", "abcdefgh"], gold=1)
    assert m == {"acc": 0.0, "acc_norm": 1.0, "acc_bytes": 1.0}
    m = choice_metrics([-2.0, -1.5], ["é", "e"], gold=0)  # 1 character each; "é" is 2 bytes
    assert (m["acc_norm"], m["acc_bytes"]) == (0.0, 1.0)


def test_mean_stderr():
    assert mean_stderr([1.0, 0.0, 1.0, 0.0]) == pytest.approx(math.sqrt(1 / 3) / 2)
    assert math.isnan(mean_stderr([1.0]))


def test_token_budget_batches_give_the_same_numbers():
    model = ToyLM(vocab_size=50, d=8).eval()
    g = torch.Generator().manual_seed(1)
    reqs = [(torch.randint(0, 50, (n,), generator=g).tolist(), [1, 2]) for n in (3, 40, 17, 9, 25)]
    a = loglikelihood_tokens(model, reqs, batch_size=8, max_batch_tokens=None, progress=False)
    b = loglikelihood_tokens(model, reqs, batch_size=8, max_batch_tokens=30, progress=False)  # 1-3 rows per batch
    assert [x[0] for x in a] == pytest.approx([x[0] for x in b], abs=1e-5)
