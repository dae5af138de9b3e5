"""Formats rows as a plain-text table."""


def table(rows):
    width = max(len(str(k)) for k, _ in rows)
    return "\n".join(f"{str(k):<{width}}  {v}" for k, v in rows)
