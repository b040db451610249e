"""Continuous batching: which tokens of which requests run in the next step."""
