"""Predictors and speculation policy for Bunshin (built on bunshin_async)."""
