"""The ssmq command: defaults, output, and one-line errors with a non-zero exit."""

from __future__ import annotations

import subprocess
import sys

from conftest import shared_or_skip
from hf_tiny import save_tiny


def run(*args, env=None):
    import os

    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "ssmq.cli", *args], capture_output=True, text=True, env=full_env,
                          timeout=300)


def test_generate_with_no_model_argument_uses_the_default_model():
    shared_or_skip("models", "mamba2")
    r = run("generate", "--max-new-tokens", "8", env={"SSMQ_MODEL": ""})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The song was released as a single") and len(r.stdout.split()) > 10


def test_info_reports_parameters_and_state(tmp_path):
    save_tiny("hybrid", tmp_path)
    shared_or_skip("tokenizers")
    r = run("info", "--model", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "hybrid" in r.stdout and "KV cache per token" in r.stdout and "state per sequence" in r.stdout


def test_errors_are_one_line_and_nonzero(tmp_path):
    for args in (["generate", "--model", str(tmp_path / "nope")], ["info", "--model", str(tmp_path)]):
        r = run(*args)
        assert r.returncode == 1
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("ssmq: error:"), r.stderr


def test_eval_with_no_model_argument_uses_the_default_model(tmp_path):
    shared_or_skip("models", "mamba2")
    shared_or_skip("data", "eval", "wikitext2")
    out = tmp_path / "r.json"
    r = run("eval", "--tasks", "wikitext2", "--limit", "1", "--seqlen", "128", "--out", str(out), env={"SSMQ_MODEL": ""})
    assert r.returncode == 0, r.stderr
    assert "mamba2" in out.read_text() and "ppl" in out.read_text()


def test_generate_with_state_checkpoint_gives_the_same_tokens(tmp_path):
    """``--state-checkpoint K``: the SSM states are written once every K steps and replayed between; greedy decode
    of a float32 model gives the tokens of write-every-step decode."""
    save_tiny("mamba2", tmp_path)
    shared_or_skip("tokenizers")
    args = ["generate", "--model", str(tmp_path), "--dtype", "float32", "--max-new-tokens", "12", "--ignore-eos",
            "--prompt", "A", "--prompt", "B"]
    plain, replay = run(*args), run(*args, "--state-checkpoint", "4")
    assert plain.returncode == 0 and replay.returncode == 0, plain.stderr + replay.stderr
    assert replay.stdout == plain.stdout and plain.stdout.count("---") == 2
    bad = run(*args, "--state-checkpoint", "1")
    assert bad.returncode == 1 and "--state-checkpoint must be >= 2" in bad.stderr


def test_generate_timing_reports_ttft_and_tpot_without_changing_the_text(tmp_path):
    save_tiny("mamba2", tmp_path)
    shared_or_skip("tokenizers")
    args = ["generate", "--model", str(tmp_path), "--dtype", "float32", "--max-new-tokens", "6", "--ignore-eos",
            "--temperature", "0", "--prompt", "A", "--prompt", "B"]
    plain, timed = run(*args), run(*args, "--timing")
    assert plain.returncode == 0 and timed.returncode == 0, plain.stderr + timed.stderr
    assert timed.stdout == plain.stdout and "timing" not in plain.stderr
    line = [x for x in timed.stderr.splitlines() if x.startswith("timing:")]
    # two rows of 6 tokens: 6 steps, 5 gaps between them
    assert len(line) == 1 and "2 x " in line[0] and "12 tokens" in line[0] and "over 5 steps" in line[0], line


def test_token_clock_counts_a_step_where_a_row_repeats():
    from ssmq.cli import TokenClock

    clock = TokenClock()
    pairs = [(0, 5), (1, 6), (0, 7), (1, 8), (1, 9)]  # steps: {0, 1}, {0, 1}, {1} (row 0 ended)
    assert list(clock.ticks(iter(pairs))) == pairs
    assert len(clock.steps) == 3 and clock.tokens == 5 and clock.first_step_tokens == 2


def test_generate_refuses_token_ids_beyond_the_vocabulary(tmp_path):
    save_tiny("mamba2", tmp_path)  # a vocabulary smaller than the tokenizer's
    shared_or_skip("tokenizers")
    r = run("generate", "--model", str(tmp_path), "--dtype", "float32", "--max-new-tokens", "2", "--prompt", "B c")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "beyond the model's vocabulary" in r.stderr, r.stderr
