"""Run a list of tasks (perplexity and zero-shot) on one model and collect the numbers with their setting.

Task names: ``wikitext2`` (perplexity, WikiText-2 test), ``wikitext2-decode`` (the same windows scored through the
decode path: ``model.step`` over the model's cache, its state formats and decode kernels; --limit windows, default
8), ``ppl:PATH`` (perplexity of any text file), and the zero-shot tasks of :mod:`ssmq.eval.tasks` (``all`` =
wikitext2 + every zero-shot task).
"""

from __future__ import annotations

import datetime
import platform
import time
from pathlib import Path

import torch

from ssmq.errors import SSMQError
from ssmq.eval import tasks as T
from ssmq.eval.loading import max_model_length
from ssmq.eval.perplexity import decode_perplexity_of_ids, perplexity_of_file, wikitext2_path
from ssmq.paths import shared_path

ALL = ["wikitext2", *T.TASKS]
HEADLINE = {"wikitext2": "ppl", **{name: t.metrics[0] for name, t in T.TASKS.items()}}


def parse_tasks(spec: str | list[str] | None) -> list[str]:
    """Canonical task names from ``"wikitext2,lambada,..."`` or ``"all"``; unknown names raise SSMQError."""
    names = spec.split(",") if isinstance(spec, str) else list(spec or ["all"])
    out: list[str] = []
    for raw in (n.strip() for n in names):
        if not raw:
            continue
        if raw.lower() == "all":
            out += ALL
        elif raw.lower() in ("wikitext2", "wikitext", "wikitext-2"):
            out.append("wikitext2")
        elif raw.lower() in ("wikitext2-decode", "wikitext2_decode"):
            out.append("wikitext2-decode")
        elif raw.startswith("ppl:"):
            out.append(raw)
        else:
            out.append(T.resolve_task(raw).name)
    if not out:
        raise SSMQError("no task given")
    return list(dict.fromkeys(out))  # de-duplicate, keep order


def data_dir() -> Path:
    d = shared_path("data", "eval")
    if d is None:
        raise SSMQError("evaluation data folder not found: expected data/eval/ in the data folder "
                        "(set $SSMQ_SHARED to it)")
    return d


def check_limit(limit: int | None) -> None:
    if limit is not None and limit < 1:
        raise SSMQError(f"--limit must be a positive number of documents, got {limit}")


def environment(device: str) -> dict:
    env = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "torch": torch.__version__, "python": platform.python_version(), "device": device}
    if str(device).startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


def _oom_types() -> tuple[type[BaseException], ...]:
    t = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    return (t,) if t is not None else ()


def evaluate(model, tokenizer, task_names: list[str], limit: int | None = None, batch_size: int = 16,
             seqlen: int = 2048, max_length: int = 2048, progress: bool = True, ppl_batch_size: int | None = None,
             max_batch_tokens: int | None = 32768, state_checkpoint: int | None = None) -> dict:
    """``{"setting": {...}, "results": {task: {"metrics": ..., ...}}}`` for one model.

    ``seqlen`` is the perplexity window; ``max_length`` the left-truncation length of zero-shot requests (lm-eval's
    default 2048). Both are checked against the model's supported length; out-of-memory raises SSMQError.
    A batch holds at most ``batch_size`` sequences (perplexity: ``ppl_batch_size`` windows, default ``batch_size``)
    and at most ``max_batch_tokens`` tokens (None: no token cap), whichever is smaller. ``state_checkpoint``: the
    decode-path task's cache checkpoints its SSM states every K steps (ReplaySSM).
    """
    check_limit(limit)
    supported = max_model_length(model)
    for what, n in (("--seqlen", seqlen), ("max_length", max_length)):
        if supported is not None and n > supported:
            raise SSMQError(f"{what} {n} exceeds the model's supported length {supported}")
    results: dict[str, dict] = {}
    for name in task_names:
        t0 = time.perf_counter()
        try:
            if name == "wikitext2" or name.startswith("ppl:"):
                path = wikitext2_path() if name == "wikitext2" else Path(name[4:])
                rows = ppl_batch_size or batch_size
                if max_batch_tokens is not None:
                    rows = max(1, min(rows, max_batch_tokens // seqlen))
                r = perplexity_of_file(model, tokenizer, path, seqlen, rows, limit, progress)
                res = {"metrics": {"ppl": r.pop("ppl"), "nll_mean": r.pop("nll_mean")}, **r}
            elif name == "wikitext2-decode":
                ids = tokenizer.encode(wikitext2_path().read_text(encoding="utf-8"))
                r = decode_perplexity_of_ids(model, ids, seqlen, limit or 8, 0, None, progress, state_checkpoint)
                r.pop("window_nll")
                res = {"metrics": {"ppl": r.pop("ppl"), "nll_mean": r.pop("nll_mean")}, **r}
            else:
                res = T.run_task(T.TASKS[name], model, tokenizer, data_dir(), limit, batch_size, max_length, progress,
                                 max_batch_tokens)
        except _oom_types() as e:
            raise SSMQError(f"out of GPU memory on task {name} (batch size {batch_size}, seqlen {seqlen}); "
                            f"lower --batch-size or --seqlen ({str(e).splitlines()[0][:120]})") from None
        res["seconds"] = round(time.perf_counter() - t0, 2)
        results[name] = res
    setting = {"limit": limit, "batch_size": batch_size, "max_batch_tokens": max_batch_tokens, "seqlen": seqlen,
               **({"state_checkpoint": state_checkpoint} if state_checkpoint else {}),
               "max_length": max_length,
               "target_delimiter": T.DELIM, "mmlu_num_fewshot": 5}
    return {"setting": setting, "results": results}


def headline(result: dict) -> dict[str, float]:
    """``{task: headline metric}`` (wikitext2: ppl, lambada: acc, hellaswag: acc_norm, ...)."""
    out = {}
    for name, r in result["results"].items():
        key = HEADLINE.get(name, "ppl")
        out[name] = r["metrics"][key]
    return out
