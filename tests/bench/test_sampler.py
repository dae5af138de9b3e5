"""The independent sampler's bookkeeping (``_sampler``) and the check's table, without a workspace: labels per
configuration and repeat, GiB·s as the samples' integral, CPU between marks, the 5% rule."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ._sampler import Figure, Sampler, compare, disagreements
from .accounting_check import table

pytestmark = pytest.mark.unit

GIB = 1 << 30


def _sampler(samples: list[tuple[str, float, int]], marks: list[tuple[str, float]]) -> Sampler:
    s = Sampler(cgroup_parent="unused", store=None)
    s.samples, s.cpu_marks = samples, marks
    return s


def test_progress_lines_label_each_configuration_and_repeat() -> None:
    s = _sampler([], [])
    s.cpu = lambda: 1.5  # type: ignore[method-assign]
    for line in ("configuration baseline (repeat 2 of 3)", "  [baseline] calc#0 finished", "configuration oracle"):
        s.progress(line)
    assert s.cpu_marks == [("baseline (repeat 2 of 3)", 1.5), ("oracle", 1.5)]
    assert s.label == "oracle"


def test_figures_integrate_memory_and_difference_the_cpu_counter() -> None:
    s = _sampler(
        [("a", 0.0, GIB), ("a", 2.0, 3 * GIB), ("b", 3.0, GIB), ("b", 4.0, GIB)],
        [("a", 10.0), ("b", 14.0), ("", 15.0)],
    )
    assert s.figures("a") == (4.0, 3 * 1024, 4.0)
    assert s.figures("b") == (1.0, 1024, 1.0)


def test_compare_pairs_every_repeat_and_flags_beyond_five_percent() -> None:
    def config(name: str, gib_s: float) -> SimpleNamespace:
        return SimpleNamespace(name=name, total_memory_gib_s=gib_s, peak_memory_mib=3 * 1024, cpu_seconds=4.0)

    result = SimpleNamespace(configs=[config("a", 4.1)], later_repeats=[[config("a", 4.3)]])
    s = _sampler(
        [("a (repeat 1 of 2)", 0.0, GIB), ("a (repeat 1 of 2)", 2.0, 3 * GIB)]
        + [("a (repeat 2 of 2)", 5.0, GIB), ("a (repeat 2 of 2)", 7.0, 3 * GIB)],
        [("a (repeat 1 of 2)", 0.0), ("a (repeat 2 of 2)", 4.0), ("", 8.0)],
    )
    figures = compare(result, s)
    first = [("a (repeat 1 of 2)", w) for w in ("GiB·s", "peak MiB", "CPU s")]
    assert [(f.label, f.what) for f in figures[:3]] == first
    assert disagreements(figures) == ["a (repeat 2 of 2) GiB·s: experiment 4.300, independent 4.000"]  # +7.5%
    row = "| a (repeat 1 of 2) | 4.100 / 4.000 (+2.5%) | 3072.0 / 3072.0 (+0.0%) | 4.00 / 4.00 (+0.0%) |"
    assert row in table(figures).splitlines()


def test_a_figure_both_read_as_zero_agrees() -> None:
    assert Figure("a", "CPU s", 0.0, 0.0).difference == 0.0
    assert disagreements([Figure("a", "CPU s", 0.0, 0.0)]) == []
    assert disagreements([Figure("a", "CPU s", 0.1, 0.0)]) != []
