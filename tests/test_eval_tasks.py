"""Prompt construction of each task on real items matches the lm-evaluation-harness 0.4.x definition."""

import math

import pytest

from ssmq.errors import SSMQError
from ssmq.eval import suite
from ssmq.eval import tasks as T
from ssmq.paths import shared_path

DATA = shared_path("data", "eval")
needs_data = pytest.mark.skipif(DATA is None, reason="../shared/data/eval absent (set $SSMQ_SHARED)")


def first(name, limit=1):
    return T.TASKS[name].load(DATA, limit)


@needs_data
def test_lambada():
    it = first("lambada_openai")[0]
    ((ctx, cont),) = it.requests
    assert ctx.startswith("In my palm is a clear stone, and inside it is a small ivory statuette.")
    assert ctx.endswith("his mouth curved in a confident grin, I don't care about")
    assert cont == " signs"


@needs_data
def test_hellaswag():
    it = first("hellaswag")[0]
    assert it.requests[0] == ("Roof shingle removal: A man is sitting on a roof. He",
                              " is using wrap to wrap a pair of skis.")
    assert [c for _, c in it.requests][3] == " starts pulling up roofing on a roof."
    assert it.gold == 3
    it = first("hellaswag", 3244)[3243]  # WikiHow item: [header]/[title]/[step]/[substeps] tags
    assert it.requests[0][0] == (
        "Personal Care and Style: How to become a fashion consultant. Obtain your high school diploma or ged. This job "
        "requires a high school diploma or equivalent, so make sure to apply yourself and finish school. If your high "
        "school offers these classes, take art, design, and sewing to familiarize yourself with foundational concepts "
        "in fashion.")
    assert it.requests[0][1].startswith("  Many high schools have classes")  # delimiter + " Many" (lm-eval's quirk)
    assert it.requests[3][1] == ("  Earn a bachelor's degree in a fashion-related field. Degrees for the fashion "
                                 "industry include art, fashion merchandising, and marketing.")
    assert it.choices[1].startswith("Having an associate's degree")  # acc_norm length: choice without delimiter


@needs_data
def test_piqa_and_arc():
    it = first("piqa")[0]
    assert it.requests[0][0] == "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"
    assert it.requests[1][1].startswith(" Provide the guinea pig with a cage full of a few inches of bedding made of "
                                        "ripped jeans")
    assert it.gold == 0
    it = first("arc_challenge")[0]
    assert it.requests[2] == ("Question: An astronomer observes that a planet rotates faster after a meteorite impact. "
                              "Which is the most likely effect of this increase in rotation?\nAnswer:",
                              " Planetary days will become shorter.")
    assert it.gold == 2 and len(it.requests) == 4
    assert first("arc_easy")[0].requests[0][1] == " Sunlight is the source of energy for nearly all ecosystems."


@needs_data
def test_winogrande_partial_scoring():
    it = first("winogrande")[0]
    assert it.requests == [("Sarah was a much better surgeon than Maria so Sarah", " always got the easier cases."),
                           ("Sarah was a much better surgeon than Maria so Maria", " always got the easier cases.")]
    assert it.gold == 1


@needs_data
def test_mmlu_five_shot_prompt_and_per_subject_limit():
    items = first("mmlu", 2)
    assert len(items) == 2 * 57 and {it.group for it in items} == set(T.SUBJECT_CATEGORY)
    it = next(i for i in items if i.group == "anatomy")
    ctx = it.requests[0][0]
    assert ctx.startswith("The following are multiple choice questions (with answers) about anatomy.\n\n"
                          "What is the embryological origin of the hyoid bone?\nA. The first pharyngeal arch\n"
                          "B. The first and second pharyngeal arches\nC. The second pharyngeal arch\n"
                          "D. The second and third pharyngeal arches\nAnswer: D\n\n"
                          "Which of these branches of the trigeminal nerve")
    assert ctx.endswith("Answer: B\n\nA lesion causing compression of the facial nerve at the stylomastoid foramen "
                        "will cause ipsilateral\nA. paralysis of the facial muscles.\n"
                        "B. paralysis of the facial muscles and loss of taste.\n"
                        "C. paralysis of the facial muscles, loss of taste and lacrimation.\n"
                        "D. paralysis of the facial muscles, loss of taste, lacrimation and decreased salivation.\n"
                        "Answer:")
    assert ctx.count("\nAnswer:") == 6
    assert [c for _, c in it.requests] == [" A", " B", " C", " D"]
    assert next(i for i in items if i.group == "high_school_us_history").requests[0][0].startswith(
        "The following are multiple choice questions (with answers) about high school us history.\n\n")


def test_aggregation():
    items = [T.Item([("a", " b")]), T.Item([("c", " d")])]
    out = T.aggregate_lambada(items, [[(-1.0, True)], [(-3.0, False)]], ("acc", "ppl"))
    assert out["acc"] == 0.5 and out["ppl"] == pytest.approx(math.exp(2.0))
    mm = [T.Item([("q", " A"), ("q", " B"), ("q", " C"), ("q", " D")], gold, list("ABCD"), subj)
          for gold, subj in [(0, "anatomy"), (1, "anatomy"), (2, "philosophy")]]
    res = [[(-1, 0), (-2, 0), (-3, 0), (-4, 0)]] * 3  # always predicts A
    out = T.aggregate_mmlu(mm, res, ("acc",))
    assert out["acc"] == pytest.approx(1 / 3)  # micro average over questions, as lm-eval's weight_by_size
    assert out["acc_stem"] == 0.5 and out["acc_humanities"] == 0.0


def test_task_names():
    assert suite.parse_tasks("wikitext2,lambada,arc_c") == ["wikitext2", "lambada_openai", "arc_challenge"]
    assert suite.parse_tasks("all") == ["wikitext2", *T.TASKS]
    with pytest.raises(SSMQError, match="unknown task 'hellaswagg'"):
        suite.parse_tasks("hellaswagg")
