"""Evaluation: perplexity, the offline zero-shot suite (lm-eval 0.4.x definitions), an lm-eval adapter, reports.

- ``perplexity``: WikiText-2 / any text file, non-overlapping windows.
- ``scoring``: loglikelihood of (context, continuation) requests and the multiple-choice metrics.
- ``tasks``: LAMBADA, HellaSwag, PIQA, ARC-Easy/Challenge, WinoGrande, MMLU 5-shot from shared/data/eval.
- ``suite``: run a task list on one model; ``report``: compare several models; ``command``: ``ssmq eval``.
- ``lm_eval_adapter``: the ``ssmq`` model for lm-evaluation-harness (``python -m ssmq.eval.lm_eval_adapter``).
"""
