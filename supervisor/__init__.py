"""The step supervisor: one process per job step, the real parent of its tasks."""
