"""Adapters for the frameworks rollouts run in (each in its own module, importing its framework; optional extras)."""
