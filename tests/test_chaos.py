"""Short versions of the release's chaos and fuzz runs (bench/chaos.py, bench/fuzz.py): an agent
killed every few seconds loses, repeats and double-books nothing; malformed frames kill nobody."""

from __future__ import annotations

from bench import chaos, fuzz


def test_a_short_chaos_run_loses_nothing() -> None:
    assert chaos.main(["--jobs", "30", "--seconds", "25", "--min-restarts", "4",
                       "--min-sup-kills", "2", "--sup-every", "3", "--seed", "7"]) == 0


def test_a_short_fuzz_run_kills_no_daemon() -> None:
    assert fuzz.main(["--frames", "10000", "--seed", "7"]) == 0
