"""The test suite; its helpers are the package tests.support."""
