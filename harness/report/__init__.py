"""Report: views of a run folder for people (HTML) and for CI (JUnit, baselines).

- :func:`write_scenario_page`: one self-contained HTML page per scenario (inline CSS, JS
  and SVG; opens from disk with no network).
- :func:`write_index`: the run's index (a grid of scenarios by matrix axes) plus every page.
- :func:`write_junit`: one JUnit testcase per scenario.
- :func:`update_baseline` / :func:`compare_to_baseline`: keep a run's verdicts and step
  scalars, and list what a later run changed.

Reads only ``summary.json``, ``steps.csv``, ``results.csv`` and the traces' JSON metadata: no
tensor is loaded, nothing is recomputed.
"""

from harness.report.baseline import compare_to_baseline, update_baseline
from harness.report.junit import write_junit
from harness.report.index import run_expectations, write_index, write_scenario_page
from harness.report.model import divergence_line

__all__ = [
    "compare_to_baseline",
    "divergence_line",
    "run_expectations",
    "update_baseline",
    "write_index",
    "write_junit",
    "write_scenario_page",
]
