"""The supervisor's command line (supervisor/__main__.parse_args): the argv the agent and a
re-exec write reads as argparse reads it, other forms too, and what is wrong is said by argparse
(a warm supervisor has no command line: the template calls ``start``)."""

from __future__ import annotations

import argparse

import pytest

from tether.supervisor.__main__ import _argparse, parse_args

WRITTEN = [
    # agent/spawn_cold.py (cold), the template's old argv (warm), supervisor/handover.py (re-exec)
    ["--run-dir", "/var/lib/tether/run/7.1", "--lock-fd", "5", "--ready-fd", "9"],
    ["--run-dir", "/s/run/7.1", "--lock-fd", "5", "--ready-fd", "9", "--warm"],
    ["--run-dir", "/s/run/7.1", "--lock-fd", "5", "--resume-fd", "12"],
    ["--warm", "--lock-fd", "5", "--run-dir", "/s/run/7.1", "--lock-fd", "6"],  # last wins
]


@pytest.mark.parametrize("argv", WRITTEN)
def test_what_tether_writes_reads_as_argparse_reads_it(argv: list[str]) -> None:
    assert parse_args(argv) == _argparse(argv)


@pytest.mark.parametrize("argv", [
    ["--run", "/s/run/7.1", "--lock", "5"],  # abbreviations: argparse's
    ["--run-dir=/s/run/7.1", "--lock-fd=5"],
])
def test_other_forms_go_through_argparse(argv: list[str]) -> None:
    assert parse_args(argv) == argparse.Namespace(run_dir="/s/run/7.1", lock_fd=5,
                                                  resume_fd=None, ready_fd=-1, warm=False)


@pytest.mark.parametrize("argv", [
    ["--lock-fd", "5"],  # no run dir
    ["--run-dir", "/s/run/7.1", "--lock-fd", "five"],
    ["--run-dir", "/s/run/7.1", "--lock-fd", "5", "--ready-fd"],
    ["--run-dir", "/s/run/7.1", "--lock-fd", "5", "--bogus"],
])
def test_what_is_wrong_is_said_by_argparse(argv: list[str],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert "tether-supervisor: error:" in capsys.readouterr().err
