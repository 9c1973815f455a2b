"""Tests of the ktserve package (the shared code both services import)."""
