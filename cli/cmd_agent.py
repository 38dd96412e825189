"""``agent``: run the node agent in the foreground."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

from tether.cli.cluster import agent_cluster
from tether.cli.errors import CliError


def agent(state_dir: str, ns: argparse.Namespace,
          reread: Callable[[], dict[str, Any]] | None = None) -> int:
    """Run the agent; ``reread`` gives its settings again, as SIGHUP reloads them
    (``agentconf.rereader``)."""
    from tether.agent.config import (
        AgentConfig,
        AgentError,
        ServiceConfig,
        UserLimits,
        allowed_cpus,
        memory_mb,
    )
    from tether.agent.contain import default_base
    from tether.agent.daemon import Agent
    from tether.agent.schema import SchemaError
    from tether.shared.faults import agent_faults
    from tether.shared.paths import PathTooLong

    logging.basicConfig(level=ns.log_level, stream=sys.stderr,
                        format="%(asctime)s agent[%(process)d] %(levelname)s %(message)s")
    # What the format does not show is not gathered for each record (the logging HOWTO's
    # "Optimization"): no caller's frame walk, thread or multiprocessing name
    logging._srcfile = None
    logging.logThreads = False
    logging.logMultiprocessing = False
    allowed = allowed_cpus()
    if ns.cpus and ns.cpus > len(allowed) and not ns.oversubscribe:
        raise CliError(f"agent: --cpus {ns.cpus} is more than the {len(allowed)} CPUs this "
                       f"process may run on ({','.join(map(str, allowed))}); add "
                       "--oversubscribe to share them out")
    if ns.default_time is not None and ns.max_time is not None and \
            ns.default_time > ns.max_time:
        raise CliError("agent: --default-time is over --max-time")
    cfg = AgentConfig(
        state_dir=os.path.abspath(state_dir),
        cpu_ids=list(range(ns.cpus)) if ns.cpus else allowed,
        gpus=ns.gpus, memory_mb=memory_mb() if ns.memory_mb is None else ns.memory_mb,
        node=ns.node or socket.gethostname(), cancel_grace=ns.cancel_grace,
        default_time=ns.default_time, max_time=ns.max_time,
        claim_timeout=ns.claim_timeout, linger=ns.linger, cgroup=ns.cgroup,
        cgroup_base=ns.cgroup_base or default_base(os.path.abspath(state_dir)),
        default_memory_mb=ns.default_memory_mb, ksm=ns.ksm, hwloc_xml=ns.hwloc_xml,
        submit_check_timeout=ns.submit_check_timeout, pmi_store_mb=ns.pmi_store_mb,
        faults=agent_faults(),
        cluster=agent_cluster(ns),
        service=ServiceConfig(stop_for_good=ns.stop_for_good,
                              template_linger=ns.template_linger,
                              metrics_file=metrics_path(ns.metrics_file),
                              metrics_interval=ns.metrics_interval),
        limits=UserLimits(max_queued=ns.max_queued_per_user,
                          max_running=ns.max_running_per_user,
                          max_records_mb=ns.max_user_records_mb,
                          half_life=ns.fairshare_half_life, keep_ended_days=ns.keep_ended,
                          keep_ended_count=ns.keep_ended_count),
    )
    from tether.cli.agentconf import settings

    try:
        return Agent(cfg, settings(ns, cfg.state_dir), reread).run()
    except (AgentError, PathTooLong, SchemaError) as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"agent: {exc}") from None


def metrics_path(path: str | None) -> str | None:
    """``--metrics-file`` as an absolute path (the agent's working directory is no one's)."""
    return os.path.abspath(path) if path else None
