"""--tensor-parallel-size N: the GPU part over N processes, one per GPU (layers/parallel.py holds
the sharded layers). Rank 0 is the GPU service (leader.py); ranks 1..N-1 are followers
(follower.py) that run each step rank 0 hands them (messages.py)."""
