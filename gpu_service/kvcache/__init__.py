"""The paged KV cache: its sizes (config), the books the scheduler keeps (manager: a block pool
with prefix hashing, block_pool, and a host tier's index, host_tier; a sequence's share,
sequence) and the tensors the model and runner hold (tensors)."""
