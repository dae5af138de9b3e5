"""Workspaces: ``_core`` (``WorkspaceCore``, the one owner of a workspace's host state, below the fork
layer) and, above the fork layer, the facade ``_facade`` (``Workspace``), ``_gui`` (the display), ``_accounting``
(memory and CPU by the kernel's counters) and ``_gc`` (what dead processes' workspaces left). This file only
documents: importing ``_workspace._core`` runs nothing above it."""
