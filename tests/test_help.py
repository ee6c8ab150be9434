"""Every ``--help`` speaks to users: plain words (no reST markup, no module paths, no paths of a development
checkout), and every option that has a default says it."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from ssmq.cli import build_parser


def _parsers():
    out = []

    def walk(name, parser):
        out.append((name, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    walk(f"{name} {sub}", p)

    walk("ssmq", build_parser())
    return out


PARSERS = _parsers()


def test_every_command_is_covered():
    names = {n for n, _ in PARSERS}
    assert {"ssmq info", "ssmq generate", "ssmq quantize", "ssmq eval", "ssmq serve", "ssmq plan", "ssmq export",
            "ssmq bench latency", "ssmq bench throughput", "ssmq bench serve", "ssmq bench kernels",
            "ssmq bench accuracy"} <= names


@pytest.mark.parametrize("name,parser", PARSERS, ids=[n for n, _ in PARSERS])
def test_help_is_plain_and_states_defaults(name, parser):
    text = parser.format_help()
    assert "``" not in text and not re.search(r"^\s*\.\. |:(func|class|mod|meth):`", text, re.M), text
    assert not re.search(r"\bssmq\.[a-z_]+\.[a-z_]", text), re.findall(r"\bssmq\.[\w.]+", text)
    assert "../shared" not in text and "Wire-up" not in text
    for action in parser._actions:
        if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        assert action.help, f"{name} {action.option_strings[-1]} has no help"
        if action.default not in (None, False) and not action.required:
            assert "default" in action.help.lower(), f"{name} {action.option_strings[-1]}: {action.help!r}"


def test_version():
    from ssmq.version import __version__

    r = subprocess.run([sys.executable, "-m", "ssmq.cli", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"ssmq {__version__}"
