"""Offline datasets for the lm-evaluation-harness task configs in this folder (``--include_path`` it).

Each YAML here is lm-eval 0.4.x's own task config with the Hugging Face download replaced by
``custom_dataset: !function ssmq.eval.lm_eval_tasks.load_<task>``, which reads ``shared/data/eval/*.jsonl``.
Task names carry an ``ssmq_`` prefix so that they never shadow lm-eval's built-in tasks; the group ``ssmq_suite``
runs all of them. HellaSwag and WinoGrande call lm-eval's own preprocessing functions.
"""

from __future__ import annotations

from ssmq.errors import SSMQError
from ssmq.paths import shared_path


def _dataset(rel: str, subject: str | None = None):
    import datasets

    from ssmq.eval.tasks import read_jsonl

    path = shared_path("data", "eval", *rel.split("/"))
    if path is None:
        raise SSMQError(f"data/eval/{rel} not found in the data folder (set $SSMQ_SHARED to it)")
    rows = read_jsonl(path)
    if subject is not None:
        rows = [r for r in rows if r["subject"] == subject]
    return datasets.Dataset.from_list(rows)


def load_lambada_openai(**_):
    return {"test": _dataset("lambada_openai/test.jsonl")}


def load_hellaswag(**_):
    return {"validation": _dataset("hellaswag/validation.jsonl")}


def load_piqa(**_):
    return {"validation": _dataset("piqa/validation.jsonl")}


def load_arc_easy(**_):
    return {"test": _dataset("arc_easy/test.jsonl")}


def load_arc_challenge(**_):
    return {"test": _dataset("arc_challenge/test.jsonl")}


def load_winogrande(**_):
    return {"validation": _dataset("winogrande/validation.jsonl")}


def load_mmlu(subject: str, **_):
    return {"test": _dataset("mmlu/test.jsonl", subject), "dev": _dataset("mmlu/dev.jsonl", subject)}
