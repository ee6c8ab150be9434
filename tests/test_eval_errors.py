"""Bad input to ``ssmq eval`` ends as one clear SSMQError line."""

import argparse

import pytest
import torch

from ssmq.errors import SSMQError
from ssmq.eval import command, suite
from ssmq.eval import tasks as T
from toy_lm import ToyLM


def args(**kw):
    p = argparse.ArgumentParser()
    command.add_arguments(p)
    ns = p.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


class ByteTokenizer:
    eos_id = 0

    def encode(self, s):
        return list(s.encode("utf-8"))


def one_line(excinfo):
    msg = str(excinfo.value)
    assert msg and "\n" not in msg
    return msg


def test_unknown_task():
    with pytest.raises(SSMQError, match="unknown task 'lambda'") as e:
        command.run(args(model="x", tasks="wikitext2,lambda"))
    assert "known: wikitext2, lambada_openai" in one_line(e)


def test_limit_zero_and_bad_sizes():
    with pytest.raises(SSMQError, match="--limit must be a positive") as e:
        command.run(args(model="x", limit=0))
    one_line(e)
    with pytest.raises(SSMQError, match="--batch-size must be positive"):
        command.run(args(model="x", batch_size=0))
    with pytest.raises(SSMQError, match="either --model M or --compare A B ..., not both"):
        command.run(args(model="x", compare=["a", "b"]))


def test_missing_data_folder(monkeypatch, tmp_path):
    monkeypatch.setattr(suite, "shared_path", lambda *parts: None)
    with pytest.raises(SSMQError, match="evaluation data folder not found") as e:
        command.run(args(model="x", tasks="piqa"))
    one_line(e)
    with pytest.raises(SSMQError, match="data file .* not found"):
        T.load_items(T.TASKS["piqa"], tmp_path)


def test_missing_model(tmp_path):
    with pytest.raises(SSMQError, match="not found"):
        command.run(args(model=str(tmp_path / "nope"), tasks="ppl:" + str(tmp_path / "t.txt"), device="cpu"))


def test_seqlen_over_supported_length(tmp_path):
    model = ToyLM(vocab_size=256, d=8)
    model.config = argparse.Namespace(max_position_embeddings=128)
    with pytest.raises(SSMQError, match="--seqlen 2048 exceeds the model's supported length 128") as e:
        suite.evaluate(model, ByteTokenizer(), ["ppl:" + str(tmp_path / "t.txt")], seqlen=2048, max_length=64)
    one_line(e)


def test_out_of_memory_is_reported(tmp_path):
    class Oom(torch.nn.Module):
        def forward(self, ids):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    text = tmp_path / "t.txt"
    text.write_text("hello " * 100)
    with pytest.raises(SSMQError, match="out of GPU memory on task ppl:.*lower --batch-size or --seqlen") as e:
        suite.evaluate(Oom(), ByteTokenizer(), ["ppl:" + str(text)], seqlen=64, progress=False)
    one_line(e)


def test_cli_prints_one_line(capsys):
    from ssmq.cli import main

    assert main(["eval", "--model", "x", "--limit", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ssmq: error: --limit must be a positive") and "\n" not in err
