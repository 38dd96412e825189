"""The pure parts of the cluster schema: fit, node states, schema versions (no database)."""

from __future__ import annotations

import pytest

from tether.shared.cluster_sql import (
    MIGRATIONS,
    SCHEMA_VERSION,
    SchemaError,
    check_version,
    demand,
    never_fits,
    node_state,
)


@pytest.mark.parametrize(("need", "size", "why"), [
    ((2, 0, 0), (2, 0, 0), None),
    ((3, 0, 0), (2, 0, 0), "needs 3 CPUs but has 2"),
    ((1, 1, 0), (4, 0, 100), "needs 1 GPUs but has 0"),
    ((1, 0, 101), (4, 0, 100), "needs 101 MB of memory but has 100"),
])
def test_never_fits(need: tuple[int, int, int], size: tuple[int, int, int],
                    why: str | None) -> None:
    assert never_fits(need, size) == why


def test_demand_counts_every_task() -> None:
    assert demand({"cpus_per_task": 2, "ntasks": 3, "gpus_req": 1, "memory_mb": 5}) == (6, 1, 5)


@pytest.mark.parametrize(("state", "drain", "shown"), [
    ("up", False, "up"), ("up", True, "draining"), ("down", False, "down"),
    ("down", True, "down"),
])
def test_node_state(state: str, drain: bool, shown: str) -> None:
    assert node_state(state, drain) == shown


def test_schema_versions() -> None:
    assert sorted(MIGRATIONS) == list(range(1, SCHEMA_VERSION + 1))
    check_version(SCHEMA_VERSION)
    for found, text in ((None, "cluster init"), (SCHEMA_VERSION + 1, "upgrade tether"),
                        (SCHEMA_VERSION - 1, "cluster init")):
        if found == 0:
            continue
        with pytest.raises(SchemaError, match=text):
            check_version(found)


def test_a_submit_option_the_cluster_does_not_carry_is_refused() -> None:
    """An option added to ``submit`` later must not be dropped silently for cluster jobs: each
    is carried or refused by name, and a new one fails this until someone decides."""
    from tether.agent.api import SUBMIT_ARGS
    from tether.agent.cluster_api import CARRIED, NOT_YET, uncarried

    assert set(SUBMIT_ARGS) | {"requeue", "script", "slurm_env"} == CARRIED | set(NOT_YET)
    assert uncarried({"command": ["true"], "time_limit": 60.0, "array": None,
                      "dependency": "afterok:1"}) == []
    assert uncarried({"later_option": 5, "array": None}) == ["--later-option"]


def test_a_cluster_jobs_dependencies_and_priority_read_as_a_nodes() -> None:
    from tether.shared.cluster_sql import dependency_text, priority

    assert [dependency_text(d) for d in (["afterok", 7], ["aftercorr", -5], ["singleton", 0])] \
        == ["afterok:7", "aftercorr:5_*", "singleton"]
    assert priority({"state": "pending", "factor": 0.25}) == 250_000
    assert priority({"state": "running", "factor": 0.25}) is None
    assert priority({"state": "pending"}) is None  # a query that did not ask
