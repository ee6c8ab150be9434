"""Comparison reports (JSON + Markdown with deltas against the first model) and ``ssmq eval`` end to end."""

import json

import pytest

from ssmq.eval import report, suite
from toy_lm import ToyLM
from ssmq.paths import shared_path


def fake_run(ppl, acc, acc_norm):
    return {"model": "m", "dtype": "float16", "environment": {"device": "cpu", "date": "today"},
            "setting": {"limit": 5, "seqlen": 2048, "max_length": 2048, "batch_size": 16, "mmlu_num_fewshot": 5},
            "results": {"wikitext2": {"metrics": {"ppl": ppl}},
                        "hellaswag": {"metrics": {"acc_norm": acc_norm, "acc": acc}}}}


def test_report_json_markdown_and_deltas(tmp_path, capsys):
    runs = [("fp16", fake_run(20.0, 0.40, 0.50)), ("w4a8", fake_run(21.5, 0.38, 0.455))]
    paths = report.write(runs, tmp_path / "cmp.json")
    doc = json.loads(paths["json"].read_text())
    assert doc["baseline"] == "fp16" and doc["models"] == ["fp16", "w4a8"]
    assert doc["deltas"]["w4a8"]["wikitext2/ppl"] == pytest.approx(1.5)
    assert doc["deltas"]["w4a8"]["hellaswag/acc_norm"] == pytest.approx(-0.045)
    md = paths["md"].read_text()
    assert "| task | metric | fp16 | w4a8 |" in md
    assert "| wikitext2 | ppl | 20.000 | 21.500 (+1.50) |" in md
    assert "| hellaswag | acc_norm (%) | 50.00 | 45.50 (-4.50) |" in md
    try:
        import matplotlib  # noqa: F401

        assert paths["png"].stat().st_size > 0
    except ImportError:
        assert "png" not in paths and "matplotlib is not installed" in capsys.readouterr().out


@pytest.mark.slow  # ~20 s: the transformers Mamba runs its slow reference path on CPU
@pytest.mark.skipif(shared_path("models", "mamba1") is None or shared_path("data", "eval") is None,
                    reason="../shared/models/mamba1 or ../shared/data/eval absent")
def test_ssmq_eval_end_to_end_agrees_with_transformers(tmp_path):
    """`ssmq eval --compare` of ssmq's model and the transformers one on the same items: same numbers."""
    from ssmq.cli import main

    path = str(shared_path("models", "mamba1"))
    out = tmp_path / "cmp.json"
    assert main(["eval", "--compare", f"ssmq={path}", f"hf=hf:{path}", "--tasks", "wikitext2,piqa,winogrande",
                 "--limit", "2", "--seqlen", "256", "--device", "cpu", "--out", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    ours, ref = doc["runs"]["ssmq"]["results"], doc["runs"]["hf"]["results"]
    assert ours["wikitext2"]["n_windows"] == 2 and ours["wikitext2"]["seqlen"] == 256
    assert ours["wikitext2"]["metrics"]["ppl"] == pytest.approx(ref["wikitext2"]["metrics"]["ppl"], rel=1e-3)
    for task in ("piqa", "winogrande"):
        assert ours[task]["metrics"]["acc"] == ref[task]["metrics"]["acc"]
    assert out.with_suffix(".md").exists()


@pytest.mark.skipif(shared_path("models", "mamba2") is None or shared_path("data", "eval") is None,
                    reason="../shared/models/mamba2 or ../shared/data/eval absent")
def test_ssmq_eval_decode_path_perplexity(tmp_path):
    """`--tasks wikitext2-decode`: the same windows through model.step over a cache, teacher-forced: on CPU in
    float32 the same perplexity as the full-window forward."""
    from ssmq.cli import main

    out = tmp_path / "r.json"
    assert main(["eval", "--model", str(shared_path("models", "mamba2")), "--tasks", "wikitext2,wikitext2-decode",
                 "--limit", "2", "--seqlen", "96", "--device", "cpu", "--dtype", "float32", "--out", str(out),
                 "--no-progress"]) == 0
    res = json.loads(out.read_text())["runs"]["mamba2"]["results"]
    fwd, dec = res["wikitext2"], res["wikitext2-decode"]
    assert dec["n_windows"] == 2 and dec["seqlen"] == 96 and dec["n_tokens_predicted"] == fwd["n_tokens_predicted"]
    assert dec["metrics"]["ppl"] == pytest.approx(fwd["metrics"]["ppl"], rel=1e-4)


def test_headline_metrics():
    res = {"results": {"wikitext2": {"metrics": {"ppl": 3.0}},
                       "arc_challenge": {"metrics": {"acc": 0.1, "acc_norm": 0.2}}}}
    assert suite.headline(res) == {"wikitext2": 3.0, "arc_challenge": 0.2}
    assert ToyLM  # the toy model is importable for smoke runs
