from .core import summarize

__all__ = ["summarize"]
