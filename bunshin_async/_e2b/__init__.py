"""An E2B-compatible server on Bunshin workspaces (``bunshin e2b serve``; public face: ``integrations.e2b``).

The unmodified ``e2b`` SDK talks to two services: the control plane (REST with an ``X-API-KEY`` header: create,
connect, list, kill, timeout, pause, fork, snapshots) and, per sandbox, the in-sandbox daemon ``envd`` (Connect RPC
in JSON: ``process.Process`` and ``filesystem.Filesystem``, plus HTTP ``/files`` and ``/health``). Both are served
on one port; envd requests carry ``E2b-Sandbox-Id`` (which sandbox) and ``X-Access-Token`` (that sandbox's secret,
handed out by the control plane).

Modules, top to bottom: ``_app`` (the ASGI app: routing, authentication, bounded bodies), ``_envd`` (the envd
services on a workspace), ``_sandboxes`` (the registry: lifecycle, timeouts and the reaper, fork, snapshots, pause),
``_templates`` (template builds as snapshots of a built workspace), ``_wire`` (the JSON shapes of both protocols and
Connect's framing). Everything reaches a workspace through the
public ``Workspace`` API (exec, spawn, read_file, write_file, fork, snapshot): the host never looks a path up inside
a workspace.
"""
