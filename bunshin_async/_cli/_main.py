"""The ``bunshin`` console script."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bunshin", description="Bunshin: forkable agent workspaces.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("doctor", help="show which capabilities this host has")
    setup = sub.add_parser("setup", help="set this host up (root, Debian 12/13): packages, CRIU, store, images")
    setup.add_argument("--no-images", action="store_true", help="do not build the workspace images")
    setup.add_argument("--gui", action="store_true", help="also build the GUI image")
    img = sub.add_parser("image", help="manage workspace images").add_subparsers(dest="action", required=True)
    build = img.add_parser("build", help="build (or reuse) the Debian base image with debootstrap")
    build.add_argument("--force", action="store_true")
    build.add_argument("--gui", action="store_true", help="build the GUI image (base + Xvfb and X tools) instead")
    imp = img.add_parser("import", help="import a container image into the layer store")
    imp.add_argument("source", help="an OCI layout (dir or tarball), a `docker save` archive, or a local engine REF")
    imp.add_argument("--name", help="a reference to record for it (name:tag)")
    img.add_parser("ls", help="list the imported images")
    rm = img.add_parser("rm", help="remove imported images (by reference or digest) and their unshared layers")
    rm.add_argument("refs", nargs="+")
    sub.add_parser("demo", help="create a workspace, run tools in it and print what happened")
    sub.add_parser("gc", help="remove workspaces left behind by a process that died")
    sub.add_parser("snapstore", help="mount the snapshot store (a tmpfs with large folios) unless it is mounted")
    sub.add_parser("replay-server", help="serve recorded trajectories as an OpenAI-compatible endpoint")
    mcp = sub.add_parser("mcp", help="serve workspaces' tools over MCP (needs bunshin[mcp])")
    mcp.add_argument("action", choices=["serve"])
    mcp.add_argument("--transport", choices=["stdio", "http"], default="stdio")
    mcp.add_argument("--host", default="127.0.0.1", help="http: address to listen on (default: loopback only)")
    mcp.add_argument("--port", type=int, default=8000, help="http: port (default 8000)")
    mcp.add_argument("--path", default="/mcp", help="http: endpoint path (default /mcp)")
    mcp.add_argument("--display", action="store_true", help="give every workspace a virtual display and GUI tools")
    mcp.add_argument("--max-workspaces", type=int, default=32)
    mcp.add_argument("--cache", action="store_true", help="serve repeated calls from a tool prefix cache")
    from ._e2b_cli import add_arguments as add_e2b_arguments

    add_e2b_arguments(sub.add_parser("e2b", help="serve an E2B-compatible API on workspaces (needs bunshin[e2b])"))
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["replay-server"]:  # its options live with it (bunshin_async._llm._replay_cli.main)
        from .._llm._replay_cli import main as replay_main

        return replay_main(argv[1:])
    args = parser.parse_args(argv)

    if args.cmd == "doctor":
        from ._doctor import report

        text, ok = report()
        print(text)
        return 0 if ok else 1
    if args.cmd == "setup":
        from ._setup import main as setup_main

        return setup_main(images=not args.no_images, gui=args.gui)
    if args.cmd == "image" and args.action != "build":
        from ._image_cli import image_command

        return image_command(args)
    if args.cmd == "image":
        from .._images._image import build_base_image, build_gui_image

        if args.gui:
            image = build_gui_image(force=args.force)
            print(f"GUI image ready: {image.rootfs}")
        else:
            image = build_base_image(force=args.force)
            print(f"base image ready: {image.rootfs}")
        return 0
    if args.cmd == "gc":
        from .._workspace._gc import collect

        for line in collect():
            print(line)
        return 0
    if args.cmd == "snapstore":
        from .._exceptions import CapabilityMissing
        from .._host._snapstore import prepare_snapshot_store

        try:
            print(f"snapshot store: {prepare_snapshot_store()}")
        except CapabilityMissing as exc:
            print(f"bunshin snapstore: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.cmd == "mcp":
        from ._mcp_cli import serve_main

        return serve_main(args)
    if args.cmd == "e2b":
        from ._e2b_cli import serve_main as e2b_serve

        return e2b_serve(args)
    if args.cmd == "demo":
        import anyio

        from ._demo import demo

        anyio.run(demo)
        return 0
    return 2
