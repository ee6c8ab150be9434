"""ssmq as an lm-evaluation-harness 0.4.x model named ``ssmq``.

lm-eval has no plugin entry point for models, so the class registers itself when this module is imported. Run the
harness through this module (same arguments as ``lm_eval``; the offline task configs are added to the include path):

    python -m ssmq.eval.lm_eval_adapter --model ssmq --model_args pretrained=PATH[,quantized=DIR][,dtype=float16] \\
        --tasks ssmq_suite --device cuda --batch_size 16

Offline tasks (``ssmq/eval/lm_eval_tasks``): ``ssmq_lambada_openai ssmq_hellaswag ssmq_piqa ssmq_arc_easy
ssmq_arc_challenge ssmq_winogrande ssmq_mmlu`` and the group ``ssmq_suite``. From Python::

    import lm_eval, ssmq.eval.lm_eval_adapter as A
    lm_eval.simple_evaluate(model=A.SSMQLM(model=m, tokenizer=tok), tasks=[...], task_manager=A.task_manager())

Scoring is :func:`ssmq.eval.scoring.loglikelihood_tokens` (the built-in scorer), fed by lm-eval's own tokenisation
of requests (``TemplateLM._encode_pair``) and its rolling windows (``loglikelihood_rolling``).
``generate_until`` is greedy: prefill + ``model.step`` with the model's cache when it has ``allocate_cache``/``step``,
else one full forward per new token.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from ssmq.eval.loading import load_for_eval, parse_spec, resolve_device, resolve_dtype
from ssmq.eval.scoring import loglikelihood_tokens, model_device

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"


def task_manager(**kwargs):
    """An lm-eval ``TaskManager`` that also knows the offline ``ssmq_*`` tasks."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), **kwargs)


@register_model("ssmq")
class SSMQLM(TemplateLM):
    """``pretrained``: model folder (or ``hf:PATH`` for the transformers reference); ``quantized``: checkpoint dir.

    Or pass a loaded ``model`` (any ``forward(input_ids) -> logits`` module) and ``tokenizer`` (``encode``,
    ``decode``, ``eos_id``).
    """

    def __init__(self, pretrained: str | None = None, quantized: str | None = None, dtype: str | None = None,
                 device: str | None = None, batch_size: int | str = 16, max_length: int = 2048,
                 max_gen_toks: int = 256, max_batch_tokens: int = 32768, model=None, tokenizer=None, **_ignored):
        super().__init__()
        if model is None:
            if pretrained is None:
                raise ValueError("ssmq: pass pretrained=PATH in --model_args")
            device = resolve_device(device)
            spec = parse_spec(str(pretrained), None if quantized is None else str(quantized))
            model, tokenizer = load_for_eval(spec, resolve_dtype(dtype, device), device)
        self.model, self.tokenizer = model.eval(), tokenizer
        bs = str(batch_size).split(":")[0]
        self.batch_size = 16 if bs == "auto" else int(bs)  # "auto" is not searched: a fixed 16
        self.max_length = int(max_length)
        self.max_gen_toks = int(max_gen_toks)
        self.max_batch_tokens = int(max_batch_tokens)

    # --- tokenisation (TemplateLM) ----------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(list(tokens))

    # --- scoring ---------------------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        out = loglikelihood_tokens(self.model, [(ctx, cont) for _, ctx, cont in requests], self.batch_size,
                                   self.max_length, not disable_tqdm, "loglikelihood", self.max_batch_tokens)
        for (key, _, _), answer in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Sum of token loglikelihoods of each whole string: disjoint windows of ``max_length``, EOS as the prefix."""
        windows, owner = [], []
        for i, (string,) in enumerate(r.args for r in requests):
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((ctx, cont))
                owner.append(i)
        scores = loglikelihood_tokens(self.model, windows, self.batch_size, self.max_length, not disable_tqdm,
                                      "loglikelihood_rolling", self.max_batch_tokens)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, scores):
            totals[i] += ll
        for r, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return totals

    # --- generation ------------------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for r in tqdm(requests, desc="generate_until", disable=disable_tqdm):
            context, gen_kwargs = r.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            eos_text = self.tok_decode([self.eot_token_id])
            if eos_text not in until:
                until.append(eos_text)
            max_new = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
            ids = self.tok_encode(context)[-max(1, self.max_length - max_new):]
            text = self.tok_decode(greedy_generate(self.model, ids, max_new, self.eot_token_id,
                                                   stop=lambda toks: _hit(self.tok_decode(toks), until)))
            for term in until:
                if term:
                    text = text.split(term)[0]
            self.cache_hook.add_partial("generate_until", (context, r.args[1]), text)
            out.append(text)
        return out


def _hit(text: str, until: list[str]) -> bool:
    return any(term and term in text for term in until)


@torch.no_grad()
def greedy_generate(model, ids: list[int], max_new_tokens: int, eos_id: int | None = None, stop=None) -> list[int]:
    """Greedy continuation of ``ids`` (new tokens only): stops at EOS, at ``stop(new_tokens)`` or after the budget."""
    device = model_device(model)
    new: list[int] = []
    x = torch.tensor([ids], dtype=torch.long, device=device)  # (1, l)
    cached = hasattr(model, "allocate_cache") and hasattr(model, "step")
    if cached:
        cache = model.allocate_cache(1, len(ids) + max_new_tokens)
        logits = model(x, cache=cache)[:, -1]  # (1, V)
    else:
        logits = model(x)[:, -1]
    for _ in range(max_new_tokens):
        tok = int(logits[0].argmax())
        if eos_id is not None and tok == eos_id:
            break
        new.append(tok)
        if stop is not None and stop(new):
            break
        if cached:
            logits = model.step(torch.tensor([tok], device=device), cache)  # (1, V)
        else:
            x = torch.cat([x, torch.tensor([[tok]], device=device)], dim=1)
            logits = model(x)[:, -1]
    return new


def main(argv: list[str] | None = None) -> None:
    """``lm_eval``'s command line with the ``ssmq`` model registered and the offline tasks on the include path."""
    from lm_eval.__main__ import cli_evaluate

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and "--include_path" not in argv and not {"-h", "--help"} & set(argv):
        argv += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
