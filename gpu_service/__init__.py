"""The GPU side of ktserve: models (everything but the routed experts), KV cache, and the engine."""
