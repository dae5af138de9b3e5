"""The documentation site: it builds strictly, the API reference has every public name, the README stays a front
door, and the benchmark pages are what the results give."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import sys
import types
from pathlib import Path

import pytest
import yaml

from tests.docs.conftest import ROOT
from tests.test_exported_members import public_modules


def hooks() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_report"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def nav() -> list[str]:
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *a: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)  # noqa: S506 - our own file
    return list(hooks().nav_pages(config["nav"]))


def test_the_reference_has_a_page_per_public_module(site: Path) -> None:
    modules = set(hooks().public_modules())
    assert {p.stem for p in (site / "reference").glob("*.html")} - {"index"} == modules
    # the same modules test_exported_members checks (it leaves out verl, which lives in its own environment)
    assert set(public_modules()) <= modules
    index = (site / "reference" / "index.html").read_text()
    assert all(f'href="{m}.html"' in index for m in modules)


def test_the_api_reference_shows_exactly_the_public_names(site: Path) -> None:
    h = hooks()
    names = 0
    for module, path in h.public_modules().items():
        html = (site / "reference" / f"{module}.html").read_text()
        shown = {i for i in re.findall(r'id="([^"]+)"', html) if re.fullmatch(re.escape(module) + r"\.[^.]+", i)}
        exported = {f"{module}.{name}" for name in h.exported_names(path)}
        assert shown == exported, (module, sorted(exported - shown), sorted(shown - exported))
        names += len(exported)
    assert names > 150  # every module's __all__ was read


@pytest.mark.unit
def test_a_missing_public_name_fails_the_strict_build(caplog: pytest.LogCaptureFixture) -> None:
    h = hooks()
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_uri="reference/bunshin_async.transfer.md"))
    html = '<h2 id="bunshin_async.transfer.export_snapshot">export_snapshot</h2>'
    with caplog.at_level(logging.WARNING, logger="mkdocs"):
        h.on_page_content(html, page, None, None)
    assert "import_snapshot" in caplog.text and "export_snapshot" not in caplog.text.split(":")[-1]


@pytest.mark.unit
def test_troubleshooting_names_every_error() -> None:
    import bunshin_async

    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    errors = [n for n in bunshin_async.__all__ if isinstance(getattr(bunshin_async, n), type)
              and issubclass(getattr(bunshin_async, n), bunshin_async.BunshinError)]  # fmt: skip
    assert len(errors) > 20
    missing = [n for n in errors if n != "BunshinError" and f"`{n}" not in text]
    assert not missing, f"docs/troubleshooting.md does not say when these are raised: {missing}"


def test_llms_txt_links_every_page_of_the_nav(site: Path) -> None:
    text = (site / "llms.txt").read_text()
    for page in nav():
        if page.startswith("reference/") and page != "reference/index.md":
            continue
        assert f"({page})" in text, page


@pytest.mark.unit
def test_readme_is_a_front_door() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 12 * 1024, len(text.encode())
    assert re.search(r"^make run ", text, re.M) and re.search(r"^make test ", text, re.M)  # .ci/run calls make test
    assert "## Use Bunshin from your own environment" in text
    for link in re.findall(r"\]\((docs/[^)#]+)", text):  # the links into the docs resolve
        assert (ROOT / link).exists(), link


@pytest.mark.unit
def test_benchmark_pages_are_generated_from_the_results() -> None:
    """No hand-edited figure: the pages and the headline tables are exactly what the records give."""
    assert report().render(check=True) == 0


@pytest.mark.unit
def test_make_bench_records_every_benchmark_of_the_generator() -> None:
    [line] = [x for x in (ROOT / "Makefile").read_text().splitlines() if x.startswith("BENCHES =")]
    assert sorted(line.split("=", 1)[1].split()) == sorted(report().BENCHES)


@pytest.mark.unit
def test_the_benchmark_nav_lists_every_generated_page() -> None:
    pages = {p.removeprefix("benchmarks/").removesuffix(".md") for p in nav() if p.startswith("benchmarks/")}
    assert pages == {"index", "speculation", "speculation-history", *report().BENCHES}


@pytest.mark.unit
def test_generic_tables_show_every_figure() -> None:
    r = report()
    result = {
        "mib": 200,
        "cow": {"n1": {"fork_total_ms": {"median": 131.0, "p90": 140.0}, "total_pss_mib": 248}},
        "stores": {"memory": {"lookup_us": 0.5, "insert_us": 0.4}, "sqlite": {"lookup_us": 72, "insert_us": 93}},
        "runs": [{"config": "baseline", "latency": 48.8}, {"config": "fork", "latency": 35.4}],
    }
    out = {section: (header, rows) for section, header, rows in r.tables(result)}
    assert out[()] == (["", "value"], [["mib", "200"]])
    assert out[("stores",)] == (["", "lookup us", "insert us"], [["memory", "0.5", "0.4"], ["sqlite", "72", "93"]])
    assert out[("runs",)] == (["config", "latency"], [["baseline", "48.8"], ["fork", "35.4"]])
    assert out[("cow", "n1")] == (["", "value"], [["total pss mib", "248"]])
    assert out[("cow", "n1", "fork total ms")] == (["", "value"], [["median", "131"], ["p90", "140"]])


@pytest.mark.unit
def test_the_headline_reads_the_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r = report()
    monkeypatch.setattr(r, "RESULTS", tmp_path)
    assert "No benchmark results" in r.headline()
    record = {
        "benchmark": "fork", "started": "2026-12-03 09:00 UTC", "quick": True, "load": {"max": 1.5},
        "result": {"measured": {"first_fork_ms": 131.0, "fork_8_ms": 231.0}},
    }  # fmt: skip
    r.record_path("fork").write_text(json.dumps(record))
    table = r.headline()
    row = (
        "| live fork of a workspace holding 200 MiB: 1 copy / 8 copies | 131 / 231 ms | [fork](docs/benchmarks/fork.md)"
    )
    assert row + " (2026-12-03, load 1.5, quick run) |" in table
    assert "create a workspace" not in table  # no record, no row
