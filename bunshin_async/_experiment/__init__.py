"""The latency-hiding experiment (``bunshin bench``, the README's main command)."""
