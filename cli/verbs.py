"""What every verb's options start from: the verb's parser with the shared ``--state-dir``, and
``--json``. Used by parser.py's ``build_parser`` and by the option tables (``options_jobs.py``,
``options_node.py``), which parser.py imports: apart from it, so that they need not import it
back (an import cycle).
"""

from __future__ import annotations

import argparse

TYPE_CHECKING = False  # typing costs every CLI run ~2 ms: for the type checker only
if TYPE_CHECKING:
    from typing import Any

STATE_DIR_HELP = ("the agent's state directory (default: $TETHER_STATE_DIR, else /var/lib/tether "
                  "for root, else $XDG_STATE_HOME/tether or ~/.local/state/tether)")


def verb(sub: Any, name: str, help: str, description: str = "", usage: str | None = None,
         epilog: str | None = None) -> Any:
    """A subcommand with the shared ``--state-dir`` (accepted after the verb too)."""
    sp = sub.add_parser(name, prog=f"tether {name}", help=help, usage=usage,
                        description=description or help[:1].upper() + help[1:] + ".",
                        epilog=epilog)
    # SUPPRESS: absent here means "keep what came before the verb", not "set to None".
    sp.add_argument("--state-dir", metavar="DIR", default=argparse.SUPPRESS, help=STATE_DIR_HELP)
    return sp


def add_json(sp: Any, what: str) -> None:
    sp.add_argument("--json", action="store_true", help=f"print {what} as JSON")
