"""The tool model and the built-in tools (``_tools``), and the GUI tools over ``ws.gui`` (``_gui_tools``):
what ``bunshin_async.tools`` re-exports."""
