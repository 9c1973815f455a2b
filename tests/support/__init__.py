"""What the tests share: tiny checkpoints, real subprocesses and their clients."""
