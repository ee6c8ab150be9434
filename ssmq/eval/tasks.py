"""The zero-shot suite, read offline from ``../shared/data/eval/*`` JSONL, with lm-evaluation-harness 0.4.x prompts.

Each task turns a document into an :class:`Item`: the ``(context, continuation)`` requests to score and the gold
index. The definitions follow lm-eval's task configs (``lm_eval/tasks/<task>/*.yaml`` and their ``utils.py``):

- lambada_openai: context = text up to the last space, continuation = " " + last word; acc (greedy match) and
  ppl = exp(-mean loglikelihood of the last word).
- hellaswag: context = preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize()), continuations
  " " + preprocess(ending) (preprocess: strip, " [title]" -> ". ", drop "[...]", "  " -> " "); acc, acc_norm.
- piqa: "Question: {goal}\nAnswer:" + " " + sol1 / sol2; acc, acc_norm.
- arc_easy, arc_challenge: "Question: {question}\nAnswer:" + " " + choice text; acc, acc_norm.
- winogrande (partial scoring): one context per option, the sentence before "_" with the option filled in; shared
  continuation " " + the rest after "_" (stripped); acc.
- mmlu (5-shot): "The following are multiple choice questions (with answers) about {subject}.\n\n", the first five
  dev examples of the subject each as "{question}\nA. ..\nB. ..\nC. ..\nD. ..\nAnswer: X\n\n", then the
  question the same way ending in "Answer:"; continuations " A" / " B" / " C" / " D"; acc.

``--limit N`` takes the first N documents of a task; for MMLU the first N of *each subject*, as lm-eval's limit
applies to each of its 57 subtasks. MMLU acc is the mean over all scored questions (lm-eval's ``mmlu`` group
aggregates with ``weight_by_size: True`` at both levels, i.e. a micro average); the four category means are
reported beside it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ssmq.errors import SSMQError
from ssmq.eval.scoring import choice_metrics, mean_stderr

DELIM = " "  # lm-eval's default target_delimiter
FEWSHOT_DELIM = "\n\n"  # lm-eval's default fewshot_delimiter


@dataclass
class Item:
    """One document: its requests ``(context, continuation)``, the gold index and the choice strings (acc_norm)."""

    requests: list[tuple[str, str]]
    gold: int = 0
    choices: list[str] = field(default_factory=list)
    group: str = ""  # MMLU subject


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------------------------------------------------
# per-task document -> Item


def lambada_item(doc: dict) -> Item:
    words = doc["text"].split(" ")
    return Item([(" ".join(words[:-1]), DELIM + words[-1])])


def hellaswag_clean(text: str) -> str:
    """lm-eval's hellaswag ``preprocess``: strip, " [title]" -> ". ", drop "[...]" tags, collapse double spaces once."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag_item(doc: dict) -> Item:
    query = hellaswag_clean(doc["activity_label"] + ": " + doc["ctx_a"] + " " + doc["ctx_b"].capitalize())
    choices = [hellaswag_clean(e) for e in doc["endings"]]
    return Item([(query, DELIM + c) for c in choices], int(doc["label"]), choices)


def piqa_item(doc: dict) -> Item:
    choices = [doc["sol1"], doc["sol2"]]
    context = f"Question: {doc['goal']}\nAnswer:"
    return Item([(context, DELIM + c) for c in choices], int(doc["label"]), choices)


def arc_item(doc: dict) -> Item:
    choices = list(doc["choices"]["text"])
    context = f"Question: {doc['question']}\nAnswer:"
    gold = doc["choices"]["label"].index(doc["answerKey"])
    return Item([(context, DELIM + c) for c in choices], gold, choices)


def winogrande_item(doc: dict) -> Item:
    """Partial scoring: one context per option (the sentence up to the blank, option filled in), shared continuation."""
    sentence = doc["sentence"]
    blank = sentence.index("_")
    contexts = [sentence[:blank] + doc["option1"], sentence[:blank] + doc["option2"]]
    continuation = DELIM + sentence[blank + 1:].strip()
    return Item([(c, continuation) for c in contexts], {"1": 0, "2": 1}[doc["answer"]], contexts)


MMLU_LETTERS = ["A", "B", "C", "D"]


def mmlu_question(doc: dict) -> str:
    c = doc["choices"]
    return f"{doc['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:"


def mmlu_prompt(doc: dict, shots: list[dict]) -> str:
    """lm-eval ``mmlu`` (default, 5-shot): description, then each dev example answered, then the question."""
    subject = " ".join(doc["subject"].split("_"))
    prompt = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
    for shot in shots:
        prompt += mmlu_question(shot) + DELIM + MMLU_LETTERS[shot["answer"]] + FEWSHOT_DELIM
    return prompt + mmlu_question(doc)


def mmlu_item(doc: dict, shots: list[dict]) -> Item:
    context = mmlu_prompt(doc, shots)
    return Item([(context, DELIM + x) for x in MMLU_LETTERS], int(doc["answer"]), list(MMLU_LETTERS), doc["subject"])


MMLU_CATEGORIES = {  # lm-eval's mmlu groups (tags of lm_eval/tasks/mmlu/default/mmlu_<subject>.yaml)
    "stem": "abstract_algebra anatomy astronomy college_biology college_chemistry college_computer_science "
    "college_mathematics college_physics computer_security conceptual_physics electrical_engineering "
    "elementary_mathematics high_school_biology high_school_chemistry high_school_computer_science "
    "high_school_mathematics high_school_physics high_school_statistics machine_learning",
    "other": "business_ethics clinical_knowledge college_medicine global_facts human_aging management marketing "
    "medical_genetics miscellaneous nutrition professional_accounting professional_medicine virology",
    "social_sciences": "econometrics high_school_geography high_school_government_and_politics "
    "high_school_macroeconomics high_school_microeconomics high_school_psychology human_sexuality "
    "professional_psychology public_relations security_studies sociology us_foreign_policy",
    "humanities": "formal_logic high_school_european_history high_school_us_history high_school_world_history "
    "international_law jurisprudence logical_fallacies moral_disputes moral_scenarios philosophy prehistory "
    "professional_law world_religions",
}
SUBJECT_CATEGORY = {s: cat for cat, subjects in MMLU_CATEGORIES.items() for s in subjects.split()}


# ----------------------------------------------------------------------------------------------------------------------
# loading


def _first_n(docs: list[dict], limit: int | None) -> list[dict]:
    return docs if limit is None else docs[:limit]


def _simple_loader(rel: str, make: Callable[[dict], Item]) -> Callable[[Path, int | None], list[Item]]:
    def load(data_dir: Path, limit: int | None) -> list[Item]:
        return [make(d) for d in _first_n(read_jsonl(data_dir / rel), limit)]

    return load


def load_mmlu(data_dir: Path, limit: int | None) -> list[Item]:
    shots: dict[str, list[dict]] = {}
    for d in read_jsonl(data_dir / "mmlu" / "dev.jsonl"):
        shots.setdefault(d["subject"], []).append(d)
    by_subject: dict[str, list[dict]] = {}
    for d in read_jsonl(data_dir / "mmlu" / "test.jsonl"):
        by_subject.setdefault(d["subject"], []).append(d)
    items = []
    for subject, docs in by_subject.items():
        if len(shots.get(subject, [])) < 5:
            raise SSMQError(f"mmlu/dev.jsonl has fewer than 5 examples for subject {subject!r}")
        items += [mmlu_item(d, shots[subject][:5]) for d in _first_n(docs, limit)]
    return items


# ----------------------------------------------------------------------------------------------------------------------
# aggregation


def aggregate_choice(items: list[Item], results: list[list[tuple[float, bool]]], metrics: tuple[str, ...]) -> dict:
    per_doc = [choice_metrics([ll for ll, _ in r], it.choices, it.gold) for it, r in zip(items, results)]
    out = {}
    for m in metrics:
        values = [d[m] for d in per_doc]
        out[m] = sum(values) / len(values)
        out[f"{m}_stderr"] = mean_stderr(values)
    return out


def aggregate_lambada(items: list[Item], results: list[list[tuple[float, bool]]], metrics: tuple[str, ...]) -> dict:
    lls = [r[0][0] for r in results]
    acc = [float(r[0][1]) for r in results]
    return {
        "acc": sum(acc) / len(acc),
        "acc_stderr": mean_stderr(acc),
        "ppl": math.exp(-sum(lls) / len(lls)),  # lm-eval aggregation "perplexity": exp(-mean(loglikelihood))
    }


def aggregate_mmlu(items: list[Item], results: list[list[tuple[float, bool]]], metrics: tuple[str, ...]) -> dict:
    per_doc = [choice_metrics([ll for ll, _ in r], it.choices, it.gold)["acc"] for it, r in zip(items, results)]
    out = {"acc": sum(per_doc) / len(per_doc), "acc_stderr": mean_stderr(per_doc)}
    by_cat: dict[str, list[float]] = {}
    by_subject: dict[str, list[float]] = {}
    for it, a in zip(items, per_doc):
        by_cat.setdefault(SUBJECT_CATEGORY.get(it.group, "other"), []).append(a)
        by_subject.setdefault(it.group, []).append(a)
    for cat in MMLU_CATEGORIES:
        if cat in by_cat:
            out[f"acc_{cat}"] = sum(by_cat[cat]) / len(by_cat[cat])
    out["subjects"] = {s: sum(v) / len(v) for s, v in by_subject.items()}
    return out


@dataclass(frozen=True)
class Task:
    name: str
    data: str  # path under data/eval/ that must exist
    load: Callable[[Path, int | None], list[Item]]
    aggregate: Callable
    metrics: tuple[str, ...]  # reported metrics (the first is the headline number)
    description: str = ""


TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        Task("lambada_openai", "lambada_openai/test.jsonl", _simple_loader("lambada_openai/test.jsonl", lambada_item),
             aggregate_lambada, ("acc", "ppl"), "LAMBADA (OpenAI), last word: greedy acc and perplexity"),
        Task("hellaswag", "hellaswag/validation.jsonl", _simple_loader("hellaswag/validation.jsonl", hellaswag_item),
             aggregate_choice, ("acc_norm", "acc"), "HellaSwag validation"),
        Task("piqa", "piqa/validation.jsonl", _simple_loader("piqa/validation.jsonl", piqa_item),
             aggregate_choice, ("acc", "acc_norm"), "PIQA validation"),
        Task("arc_easy", "arc_easy/test.jsonl", _simple_loader("arc_easy/test.jsonl", arc_item),
             aggregate_choice, ("acc", "acc_norm"), "ARC-Easy test"),
        Task("arc_challenge", "arc_challenge/test.jsonl", _simple_loader("arc_challenge/test.jsonl", arc_item),
             aggregate_choice, ("acc_norm", "acc"), "ARC-Challenge test"),
        Task("winogrande", "winogrande/validation.jsonl",
             _simple_loader("winogrande/validation.jsonl", winogrande_item),
             aggregate_choice, ("acc",), "WinoGrande XL validation, partial scoring"),
        Task("mmlu", "mmlu/test.jsonl", load_mmlu, aggregate_mmlu, ("acc",), "MMLU test, 5-shot (dev examples)"),
    ]
}
ALIASES = {"lambada": "lambada_openai", "arc_e": "arc_easy", "arc_c": "arc_challenge"}


def resolve_task(name: str) -> Task:
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in TASKS:
        raise SSMQError(f"unknown task {name!r}; known: wikitext2, {', '.join(TASKS)} (or 'all')")
    return TASKS[key]


def load_items(task: Task, data_dir: Path, limit: int | None = None) -> list[Item]:
    if not (data_dir / task.data).exists():
        raise SSMQError(f"task {task.name}: data file {data_dir / task.data} not found (the data folder: $SSMQ_SHARED)")
    items = task.load(data_dir, limit)
    if not items:
        raise SSMQError(f"task {task.name}: no documents in {data_dir / task.data}")
    return items


def run_task(task: Task, model, tokenizer, data_dir: Path, limit: int | None = None, batch_size: int = 16,
             max_length: int = 2048, progress: bool = True, max_batch_tokens: int | None = 32768) -> dict:
    """Score one task: ``{"metrics": {...}, "n_docs": int, "n_requests": int}``."""
    from ssmq.eval.scoring import loglikelihood

    items = load_items(task, data_dir, limit)
    flat = [req for it in items for req in it.requests]
    lls = loglikelihood(model, tokenizer, flat, batch_size, max_length, progress, task.name, max_batch_tokens)
    results, pos = [], 0
    for it in items:
        results.append(lls[pos:pos + len(it.requests)])
        pos += len(it.requests)
    return {
        "metrics": task.aggregate(items, results, task.metrics),
        "n_docs": len(items),
        "n_requests": len(flat),
    }
