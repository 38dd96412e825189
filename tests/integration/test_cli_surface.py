"""The command line's own surface, without an agent: version, usage, suggestions, help text.

Issue 13, frictions 1 (no version, no "did you mean"), 2 (option prefixes accepted silently)
and 3 (thin help, internal metavars, no ``--`` in usage).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any

import pytest

import tether
from tests.helpers import CLI
from tether.cli.parser import build_parser

USAGE = 2


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    # a state dir nobody serves: nothing here may need an agent
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "TETHER_STATE_DIR": "/nonexistent/tt"})


def one_line(res: subprocess.CompletedProcess[str]) -> str:
    err = res.stderr.rstrip("\n")
    assert err and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag: str) -> None:
    res = cli(flag)
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"tether {tether.__version__}\n"


def test_bare_tether_prints_usage_and_exits_2() -> None:
    res = cli()
    assert res.returncode == USAGE
    assert res.stderr.startswith("usage: tether")
    assert "submit" in res.stderr and "--version" in res.stderr


@pytest.mark.parametrize("typo, meant", [("sumbit", "submit"), ("lsit", "list"),
                                         ("cancle", "cancel"), ("stauts", "status")])
def test_mistyped_command_suggests_the_real_one(typo: str, meant: str) -> None:
    res = cli(typo)
    assert res.returncode == USAGE
    assert f"did you mean '{meant}'?" in one_line(res)


def test_mistyped_option_value_suggests_the_real_one() -> None:
    res = cli("submit", "--pmi", "pm1", "--", "true")
    assert res.returncode == USAGE
    err = one_line(res)
    assert "invalid choice 'pm1'; did you mean 'pmi1'?" in err and "none, pmi1, pmi2" in err


def test_unknown_option_suggests_a_close_one_of_that_command() -> None:
    res = cli("submit", "--cpu", "2", "--", "true")
    assert res.returncode == USAGE
    err = one_line(res)
    assert err.startswith("tether submit:") and "did you mean '--cpus'?" in err


@pytest.mark.parametrize("argv, prefix", [
    (["submit", "--cpu", "2", "--", "true"], "--cpu"),
    (["submit", "--memory", "5", "--", "true"], "--memory"),  # --mem is an option of its own
    (["list", "--state-d", "/tmp"], "--state-d"),
    (["--state", "/tmp", "status"], "/tmp"),
    (["wait", "1", "--time", "3"], "--time"),
])
def test_option_prefixes_are_refused(argv: list[str], prefix: str) -> None:
    """An abbreviation is an error, never silently another option (friction 2)."""
    res = cli(*argv)
    assert res.returncode == USAGE, res.stderr
    assert prefix in one_line(res)


def every_parser() -> list[tuple[str, argparse.ArgumentParser]]:
    top = build_parser()
    found: list[tuple[str, argparse.ArgumentParser]] = [("tether", top)]
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            found += [(f"tether {name}", sp) for name, sp in action.choices.items()]
    return found


def test_every_parser_refuses_abbreviations() -> None:
    for name, parser in every_parser():
        assert parser.allow_abbrev is False, name


def test_every_option_and_argument_has_help() -> None:
    for name, parser in every_parser():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction) or action.dest == "command":
                continue
            assert action.help, f"{name}: {action.option_strings or action.dest} has no help"


def test_no_option_shows_its_internal_name() -> None:
    """A value's placeholder is chosen (DIR, N, SECONDS), never argparse's upper-cased dest."""
    for name, parser in every_parser():
        for action in parser._actions:
            if action.option_strings and action.nargs != 0 and not action.choices:
                assert action.metavar is not None, f"{name} {action.option_strings[0]}"


@pytest.mark.parametrize("verb", [name.split()[-1] for name, _ in every_parser()[1:]])
def test_help_of_every_command(verb: str) -> None:
    res = cli(verb, "--help")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"usage: tether {verb}")
    assert "SUB_STATE_DIR" not in res.stdout and "--state-dir DIR" in res.stdout


def test_submit_help_shows_the_separator_units_and_tokens() -> None:
    out = cli("submit", "--help").stdout
    assert "usage: tether submit [OPTIONS] -- COMMAND [ARG...]" in out
    assert "MiB" in out and "%j" in out and "(default 1)" in out


def test_help_needs_no_zeromq() -> None:
    """Parsing and help stay cheap: the verbs' imports happen only when a verb runs."""
    code = ("import sys; from tether.cli.main import main\n"
            "try:\n    main(['submit', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m == 'zmq' or m.startswith('tether.cli.cmd')"
            " or m == 'tether.shared.client'))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("argv", [["inspect", "1", "--json"], ["submit", "--wait", "--", "true"],
                                  ["wait", "1"], ["show", "1", "--json"]])
def test_hot_verbs_import_only_what_they_use(argv: list[str], tmp_path: Any) -> None:
    """What the frequent verbs load (they fail here: no agent; every import is done by then):
    no typing, dataclasses or inspect (pulled in by dataclasses), no shutil, no difflib, no
    other verb's modules, no cluster or ZeroMQ code. Each costs every run milliseconds."""
    code = ("import sys; from tether.cli.main import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m in ('typing', 'dataclasses', 'inspect', "
            "'shutil', 'difflib', 'zmq', 'psycopg', 'tether.cli.cluster', 'tether.cli.table', "
            "'tether.cli.jobfilter') or m.startswith('tether.agent')))")
    env = dict(os.environ, TETHER_STATE_DIR=str(tmp_path))
    env.pop("TETHER_CLUSTER", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30, env=env, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "[]"


def test_node_down_without_confirm_dead_is_bad_usage_even_with_no_database() -> None:
    """docs/cli.md: exit 2 without --confirm-dead. The database was connected to first, so an
    unreachable one made it exit 1 with the database's error instead (issue 26, point 7)."""
    res = subprocess.run([*CLI, "cluster", "node-down", "n1"], capture_output=True, text=True,
                         timeout=30, env={"PATH": "/usr/bin:/bin",
                                          "TETHER_CLUSTER": "host=/nonexistent/tt"})
    assert res.returncode == USAGE, res.stderr
    assert "--confirm-dead" in one_line(res)
