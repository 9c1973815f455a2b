"""The CPU expert workers as the GPU service sees them: started and supervised here
(supervisor, child_processes) or running on their own (external_workers), and the check that
their shards hold every expert once (shard_coverage)."""
