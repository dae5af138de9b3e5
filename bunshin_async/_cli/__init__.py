"""The ``bunshin`` command (``_main``; also ``python -m bunshin_async``) and its subcommands, one module each:
``doctor``, ``setup``, ``demo``, ``image``, ``mcp serve``, ``e2b serve``."""

from ._main import main as main  # the console script's entry point: bunshin_async._cli:main
