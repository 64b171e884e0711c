"""The virtual-time replay of job traces through a planner (benchmarks and tests)."""
