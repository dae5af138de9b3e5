"""MkDocs hooks of the documentation site (mkdocs.yml ``hooks``).

- The API reference has one page per public module (and a table of them on its index), made here from the
  package's layout (a module is public when no part of its dotted name starts with ``_``), so a new public module
  gets a page (and a place in the nav) without anyone writing one.
- Every name in a public module's ``__all__`` must be rendered on its page: a missing one is a warning, which
  ``mkdocs build --strict`` turns into a failed build ("undocumented public names fail").
- ``llms.txt`` (the plain-text index for coding agents) must name every page of the nav.

Everything is read statically (``ast``): the reference is built by griffe without importing the package, so
modules whose framework lives elsewhere (verl) are documented too.
"""

from __future__ import annotations

import ast
import html
import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.plugins.bunshin")

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bunshin_async", "speculator")
REFERENCE = "reference"


def public_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> source file of every public module of the packages."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if not any(p.startswith("_") for p in parts):
                found[".".join(parts)] = path
    return dict(sorted(found.items()))


def exported_names(path: Path) -> list[str]:
    """The literal ``__all__`` of a module's source (empty when it has none)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            value = ast.literal_eval(node.value)
            return [str(n) for n in value]
    return []


def first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.split("\n\n")[0].replace("\n", " ").strip()


def reference_page(module: str, names: list[str]) -> str:
    """The page of one module: its docstring, then exactly the names of its ``__all__``, in that order."""
    members = "".join(f"        - {n}\n" for n in names)
    return (
        f"# `{module}`\n\n"
        f"::: {module}\n"
        "    options:\n"
        "      show_root_heading: false\n"
        "      show_root_toc_entry: false\n"
        "      members_order: source\n" + ("      members:\n" + members if names else "      members: false\n")
    )


def reference_table(modules: dict[str, Path]) -> str:
    rows = "\n".join(f"| [`{m}`]({m}.md) | {first_line(p).replace('|', '/')} |" for m, p in modules.items())
    return "| module | what |\n|---|---|\n" + rows + "\n"


def on_config(config: Any) -> Any:
    """The nav's API reference section lists a page per public module, after its index (mkdocs.yml names only the
    index), so a module added to the package appears without an edit here."""
    for item in config["nav"] or []:
        if isinstance(item, dict) and "API reference" in item:
            item["API reference"] = [f"{REFERENCE}/index.md", *(f"{REFERENCE}/{m}.md" for m in public_modules())]
    return config


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for module, path in public_modules().items():
        page = reference_page(module, exported_names(path))
        files.append(File.generated(config, f"{REFERENCE}/{module}.md", content=page))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri == f"{REFERENCE}/index.md":
        return markdown + "\n" + reference_table(public_modules())
    return markdown


def on_page_content(html_text: str, page: Any, config: Any, files: Any) -> str:
    src = page.file.src_uri
    if src.startswith(f"{REFERENCE}/") and src != f"{REFERENCE}/index.md":
        module = src[len(REFERENCE) + 1 : -3]
        path = public_modules().get(module)
        if path is not None:
            ids = set(re.findall(r'id="([^"]+)"', html.unescape(html_text)))
            missing = [n for n in exported_names(path) if f"{module}.{n}" not in ids]
            if missing:
                log.warning("%s: public names missing from the API reference: %s", module, ", ".join(missing))
    return html_text


def nav_pages(nav: Any) -> list[str]:
    out: list[str] = []
    for item in nav:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            for value in item.values():
                out.extend(nav_pages(value) if isinstance(value, list) else [value])
    return out


def on_post_build(config: Any) -> None:
    llms = Path(config["docs_dir"]) / "llms.txt"
    text = llms.read_text() if llms.exists() else ""
    for page in nav_pages(config["nav"] or []):
        if page.startswith(f"{REFERENCE}/") and page != f"{REFERENCE}/index.md":
            continue
        if f"({page.removesuffix('.md')}" not in text:
            log.warning("llms.txt does not link %s", page)
