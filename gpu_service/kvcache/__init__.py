"""The paged KV cache: its block pool with prefix hashing (block_pool), the cache the model's
attention reads and writes (kv_cache) and its second tier in host RAM (host_tier)."""
