"""``cancel``."""

from __future__ import annotations

import argparse

from tether.cli.connect import agent_call
from tether.shared.paths import Layout


def cancel(layout: Layout, ns: argparse.Namespace) -> int:
    agent_call(layout, "cancel", {"job": ns.job})
    return 0
