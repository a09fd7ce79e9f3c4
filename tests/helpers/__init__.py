"""Shared test helpers (multi-process launch, tiny models). Import as ``from tests.helpers.dist import run_torchrun``."""
