"""A small CSV parser (no quoting)."""


def parse(text):
    return [line.split(",") for line in text.splitlines() if line.strip()]
