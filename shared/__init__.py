"""What the tether agent, its supervisors and the CLI all speak: the wire protocol, the spool
layout, process identity, and the on-disk records (spec, manifest, exit sentinel)."""

