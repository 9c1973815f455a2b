"""Drivers and generators kept beside the packages (not installed): run as `python -m tools.X`."""
