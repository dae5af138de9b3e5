"""The ``bunshin`` console script."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bunshin", description="Bunshin: forkable agent workspaces.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("doctor", help="show which capabilities this host has")
    img = sub.add_parser("image", help="manage workspace images")
    img.add_argument("action", choices=["build"])
    img.add_argument("--force", action="store_true")
    sub.add_parser("demo", help="create a workspace, run tools in it and print what happened")
    args = parser.parse_args(argv)

    if args.cmd == "doctor":
        from ._doctor import report

        text, ok = report()
        print(text)
        return 0 if ok else 1
    if args.cmd == "image":
        from ._image import build_base_image

        image = build_base_image(force=args.force)
        print(f"base image ready: {image.rootfs}")
        return 0
    if args.cmd == "demo":
        import anyio

        from ._demo import demo

        anyio.run(demo)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
