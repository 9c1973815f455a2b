"""What the routed-expert path fails with. The engine, which imports this package and never the
reverse, ends a step's requests with its own subclass (engine/errors.py: step_error)."""


class ExpertsUnavailable(RuntimeError):
    """No answer from an expert worker within the deadline (gone, or it failed the call)."""
