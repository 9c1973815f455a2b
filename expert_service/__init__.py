"""expert_service: the CPU expert worker that holds routed experts in host RAM."""
