"""Short versions of the release's chaos and fuzz runs (bench/chaos.py, bench/fuzz.py): an agent
killed every second or so loses, repeats and double-books nothing; malformed frames at every
socket kill nobody. Both are the release runs made smaller, not different: the same jobs, the
same kills and the same checks, at a pace that keeps the file well under a minute."""

from __future__ import annotations

from bench import chaos, fuzz


def test_a_short_chaos_run_loses_nothing() -> None:
    # Restarts every 0.5-1.5 s rather than 2-6 s: each one still lands mid-launch, mid-job or
    # mid-collect somewhere among 30 jobs, and four of them take seconds, not half a minute.
    assert chaos.main(["--jobs", "30", "--seconds", "10", "--min-restarts", "4",
                       "--restart-every", "0.5", "1.5", "--min-sup-kills", "2",
                       "--sup-every", "1", "--seed", "7"]) == 0


def test_a_short_fuzz_run_kills_no_daemon() -> None:
    assert fuzz.main(["--frames", "5000", "--seed", "7"]) == 0
