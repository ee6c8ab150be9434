"""lm-evaluation-harness through the ssmq adapter agrees with ssmq's built-in scorer (same requests, same numbers)."""

import re

import pytest
import torch

from ssmq.eval import tasks as T
from toy_lm import BigramLM, ToyLM
from ssmq.paths import shared_path

lm_eval = pytest.importorskip("lm_eval", reason="lm_eval not installed (pip install lm_eval==0.4.13)")
DATA = shared_path("data", "eval")
pytestmark = pytest.mark.skipif(DATA is None, reason="../shared/data/eval absent (set $SSMQ_SHARED)")

from ssmq.eval import lm_eval_adapter as A  # noqa: E402

LIMIT = 3
SUBJECTS = ["anatomy", "formal_logic", "high_school_us_history"]  # a subset of MMLU's 57 subtasks
TASK_OF = {f"ssmq_{n}": n for n in T.TASKS if n != "mmlu"} | {f"ssmq_mmlu_{s}": "mmlu" for s in SUBJECTS}


@pytest.fixture(scope="module")
def tokenizer():
    from ssmq.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def model():
    return ToyLM().eval()


@pytest.fixture(scope="module")
def harness(model, tokenizer):
    lm = A.SSMQLM(model=model, tokenizer=tokenizer, batch_size=8)
    return lm_eval.simple_evaluate(model=lm, tasks=list(TASK_OF), task_manager=A.task_manager(), limit=LIMIT,
                                   log_samples=True, bootstrap_iters=0, verbosity="ERROR")


def builtin_items(lm_task):
    name = TASK_OF[lm_task]
    items = T.TASKS[name].load(DATA, LIMIT)
    if name == "mmlu":
        items = [it for it in items if it.group == lm_task.removeprefix("ssmq_mmlu_")]
    return name, items


@pytest.mark.parametrize("lm_task", list(TASK_OF))
def test_same_requests_and_metrics(harness, model, tokenizer, lm_task):
    name, items = builtin_items(lm_task)
    samples = sorted(harness["samples"][lm_task], key=lambda s: s["doc_id"])
    assert [[tuple(a) for a in s["arguments"]] for s in samples] == [it.requests for it in items]

    from ssmq.eval.scoring import loglikelihood

    flat = [r for it in items for r in it.requests]
    lls = iter(loglikelihood(model, tokenizer, flat, batch_size=4, progress=False))
    results = [[next(lls) for _ in it.requests] for it in items]
    ours = T.TASKS[name].aggregate(items, results, T.TASKS[name].metrics)
    theirs = harness["results"][lm_task]
    for metric in ("acc", "acc_norm"):
        if f"{metric},none" in theirs:
            assert ours[metric] == pytest.approx(theirs[f"{metric},none"]), metric
    if name == "lambada_openai":
        assert ours["ppl"] == pytest.approx(theirs["perplexity,none"], rel=1e-6)


def test_hellaswag_and_winogrande_preprocessing_match_lm_eval_on_every_item():
    from lm_eval.tasks.hellaswag.utils import preprocess
    from lm_eval.tasks.winogrande import preprocess_winogrande as W

    for doc in T.read_jsonl(DATA / "hellaswag" / "validation.jsonl"):
        it = T.hellaswag_item(doc)
        query = doc["activity_label"] + ": " + doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        assert it.requests[0][0] == preprocess(query)
        assert it.choices == [preprocess(e) for e in doc["endings"]]
    for doc in T.read_jsonl(DATA / "winogrande" / "validation.jsonl"):
        it = T.winogrande_item(doc)
        assert [c for c, _ in it.requests] == W.doc_to_choice(doc)
        assert it.requests[0][1] == " " + W.doc_to_target(doc) and it.gold == W.doc_to_text(doc)


def test_loglikelihood_rolling_is_the_sum_over_the_text(model, tokenizer):
    from lm_eval.api.instance import Instance

    from ssmq.eval.scoring import loglikelihood_tokens

    lm = A.SSMQLM(model=model, tokenizer=tokenizer, max_length=2048)
    text = "The quick brown fox jumps over the lazy dog."
    (got,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    ((want, _),) = loglikelihood_tokens(model, [([tokenizer.eos_id], tokenizer.encode(text))], progress=False)
    assert got == pytest.approx(want, abs=1e-4)
    short = A.SSMQLM(model=model, tokenizer=tokenizer, max_length=4)  # several windows
    (got4,) = short.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    assert got4 < 0


class WordTokenizer:
    eos_id = 0

    def __init__(self, words):
        self.words = ["<eos>", *words]

    def encode(self, s):
        return [self.words.index(w) for w in re.findall(r"\s?\S+", s)]

    def decode(self, ids):
        return "".join(self.words[i] for i in ids)


def test_generate_until_greedy_with_stop_strings():
    from lm_eval.api.instance import Instance

    tok = WordTokenizer(["Once", " upon", " a", " time", " there", " was", " an", " end"])
    model = BigramLM(vocab_size=len(tok.words)).favour(tok.encode("Once upon a time there was an end"))
    lm = A.SSMQLM(model=model, tokenizer=tok)
    reqs = [Instance("generate_until", {}, ("Once", {"until": [" there"], "max_gen_toks": 10}), 0),
            Instance("generate_until", {}, ("Once", {"until": ["\n\n"], "max_gen_toks": 2}), 1),
            Instance("generate_until", {}, ("Once upon", {"until": "was"}), 2),
            Instance("generate_until", {}, ("Once upon a time there", {"until": ["\n"]}), 3)]
    assert lm.generate_until(reqs, disable_tqdm=True) == [" upon a time", " upon a", " a time there ", " was an end"]


def test_cached_generation_matches_full_forwards():
    class Cached(torch.nn.Module):
        """Full-forward model exposing allocate_cache/step (the cache is just the token history)."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids, cache=None):
            if cache is not None:
                cache.extend(ids[0].tolist())
            return self.inner(ids)

        def allocate_cache(self, max_batch, max_seqlen):
            return []

        def step(self, ids, cache):
            cache.append(int(ids[0]))
            return self.inner(torch.tensor([cache]))[:, -1]

    inner = ToyLM(vocab_size=40, d=8).eval()
    prompt = [3, 1, 4, 1, 5]
    assert A.greedy_generate(Cached(inner), prompt, 12) == A.greedy_generate(inner, prompt, 12)
