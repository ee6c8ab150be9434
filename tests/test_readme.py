"""The README is the front door: its setup and test commands are the ones CI runs (``.ci/run``), and it keeps a
quickstart that runs with no arguments on the default model. A README rewrite once dropped both sections."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ci_commands() -> tuple[str, str]:
    """(setup, test): the install line and the pytest line of ``.ci/run``."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    setup = next(line for line in lines if line.startswith("pip install"))
    test = next(line for line in lines if line.startswith("python -m pytest"))
    return setup.split(" ||")[0], test


def test_readme_setup_and_test_commands_are_what_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Setup and test", 1)[1].split("\n## ", 1)[0]
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", section, re.S))
    commands = [line.split("#")[0].strip() for line in blocks.splitlines()]
    setup, test = _ci_commands()
    assert commands == [setup, test], (commands, setup, test)


def test_readme_quickstart_starts_with_the_default_model():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    first = re.search(r"```bash\n(.*?)\n", section).group(1).split("#")[0].strip()
    assert first == "ssmq generate"
