"""The process and machine we run in: launch environment, ranks, disk caches."""
