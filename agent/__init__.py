"""The node agent: owns the node's resources, queues and launches jobs, and reattaches to every
live supervisor each time it starts."""
