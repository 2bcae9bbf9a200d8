"""Parallelism that needs shard_map: context parallelism (ring and all-gather attention) and expert
parallelism (all-to-all dispatch)."""
