"""Tier worker processes (job loop, pool supervisor, tier backends)."""
