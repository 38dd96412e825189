"""tether: job execution for cluster nodes.

One import root for everything tether installs: ``tether.shared`` (what every side speaks),
``tether.supervisor`` (one process per job step), ``tether.agent`` (the node daemon) and
``tether.cli`` (the ``tether`` command). In a checkout these are links to the top-level folders;
in a built wheel ``pyproject.toml`` maps the folders into this package.
"""

#: The release. Bumped by every change to the wire protocol, the on-disk records or the database
#: schema, so that two builds that cannot be told apart by it speak the same.
__version__ = "0.6.0"
