"""HTML report and baselines on small synthetic run folders (no launch)."""

from __future__ import annotations

import csv
import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

from harness.report import (
    blocks,
    compare_to_baseline,
    model,
    update_baseline,
    write_index,
    write_scenario_page,
)

ASSETS = Path(__file__).parent / "assets" / "report"
_spec = importlib.util.spec_from_file_location("report_synthetic", ASSETS / "synthetic.py")
synthetic = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(synthetic)

ODD = '<script>alert("x")</script>&layer'
SPECS = [
    {"name": "tp1-fp32", "verdict": "pass", "axes": {"topology": "tp1-gtp2", "precision": "fp32"}},
    {
        "name": "tp1-bf16",
        "verdict": "fail",
        "axes": {"topology": "tp1-gtp2", "precision": "bf16"},
        "odd_name": ODD,
    },
    {"name": "tp2-fp32", "verdict": "error", "axes": {"topology": "tp2-gtp2", "precision": "fp32"}},
    {
        "name": "tp2-bf16",
        "verdict": "fail",
        "axes": {"topology": "tp2-gtp2", "precision": "bf16"},
        "tensor": ODD,
    },
]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return synthetic.write_run(tmp_path_factory.mktemp("run"), SPECS)


@pytest.fixture(scope="module")
def report(run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    write_index(run, out)
    return out


def page(report: Path, name: str) -> str:
    return (report / "scenarios" / f"{name}.html").read_text()


def test_index_writes_pages_summary_and_grid(run, report):
    assert json.loads((report / "summary.json").read_text()) == json.loads((run / "summary.json").read_text())
    for spec in SPECS:
        assert (report / "scenarios" / f"{spec['name']}.html").is_file()
    html = (report / "index.html").read_text()
    grid = html.split('id="matrix"')[1].split("</table>")[0]
    header = re.findall(r"<th[^>]*>(.*?)</th>", grid)
    assert header[1:] == ["fp32", "bf16"]  # last axis: columns
    rows = re.findall(r"<tr><td class=\"t\">(.*?)</td>(.*?)</tr>", grid)
    assert [r[0] for r in rows] == ["tp1-gtp2", "tp2-gtp2"]
    cells = dict(zip(("tp1-fp32", "tp1-bf16"), re.findall(r'<td class="(\w+)">', rows[0][1]), strict=True))
    assert cells == {"tp1-fp32": "pass", "tp1-bf16": "fail"}
    assert re.findall(r'<td class="(\w+)">', rows[1][1]) == ["error", "fail"]
    assert 'href="scenarios/tp2-fp32.html"' in grid
    assert "ratio-G, max rel 1" in grid  # the worst metric of a failing cell
    assert 'class="verdict error"' in html  # the worst verdict of the run


def test_page_is_self_contained(report):
    for spec in SPECS:
        html = page(report, spec["name"])
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), spec["name"]
        assert "<link" not in html and "@import" not in html and "url(http" not in html
        assert html.count("<script>") == 1  # the page's own inline script, nothing else


def test_trace_strings_are_escaped(report):
    for name in ("tp1-bf16", "tp2-bf16"):
        html = page(report, name)
        assert "<script>alert" not in html
        assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;layer" in html
    assert "&lt;script&gt;alert" in (report / "index.html").read_text()


def test_failing_page_shows_divergence_curves_heatmap_table(report):
    html = page(report, "tp1-bf16")
    verdict = re.search(r'<p class="verdict fail" id="verdict">(.*?)</p>', html).group(1)
    assert verdict.startswith(
        "FAIL: 4 of 13 comparisons fail; the first is step 1 backward output_layer.weight"
    )
    assert "a mean over the GTP group became a sum" in html
    assert "rows 0-48 (GTP block 0)" in html
    for title in ("reduced loss", "grad norm", "learning rate (applied)", "max RMS error vs golden (log)"):
        assert f'class="ct">{title}</text>' in html
    assert html.count("<polyline") == 3 * 3 + 2  # three sides per curve, two drift lines
    table = html.split('id="results"')[1]
    assert table.count("<tr data-kind=") == 13 + 1
    assert table.count('data-passed="0"') == 4
    assert 'class="bad"' in html  # a heatmap cell with a failing comparison is outlined
    assert "0.19.2" in html and "megatron-w2-tp1-gtp2-fp32" in html and "synthetic" in html


def test_error_page_names_the_side_and_message(report):
    html = page(report, "tp2-fp32")
    assert 'class="verdict error"' in html and "ERROR: a run failed (candidate)" in html
    assert "rank 1 exited with code 1 at step 2" in html
    assert 'id="results"' not in html


def test_shard_picture_marks_the_worst_block_and_hatches_pads(run):
    data = model.load_scenario(run / "scenarios" / "tp1-bf16")
    pic = blocks.picture(data)
    assert (pic.rows, pic.cols) == (96, 64)
    assert [(b.row0, b.row1, b.ranks, b.pad_rows, b.marked) for b in pic.blocks] == [
        (0, 48, (0,), 0, True),
        (48, 96, (1,), 24, False),
    ]
    assert pic.worst == (24, 58)


def test_shard_blocks_tp_and_gtp():
    layout = {"logical_shape": [80, 8], "mesh": {"tp": 2, "gtp": 2, "dp": 1}, "pads": {"gtp": 8},
              "placements": {"tp": "S(0)", "gtp": "S(0)"}}
    coords = {r: {"tp": r // 2, "gtp": r % 2} for r in range(4)}
    pic = blocks.build("w", layout, coords, {"rank": 3, "rows": [40, 48]})
    # Each TP block of 40 rows is padded to 48 and cut in two GTP blocks of 24.
    assert [(b.tp, b.gtp, b.row0, b.row1, b.ranks, b.pad_rows) for b in pic.blocks] == [
        (0, 0, 0, 24, (0,), 0),
        (0, 1, 24, 48, (1,), 8),
        (1, 0, 48, 72, (2,), 0),
        (1, 1, 72, 96, (3,), 8),
    ]
    assert [b.marked for b in pic.blocks] == [False, False, False, True]
    assert pic.region == (88, 96, 0, 8)
    pic = blocks.build("w", {**layout, "placements": {"tp": "S(1)", "gtp": "S(0)"}, "logical_shape": [40, 8]},
                       coords, {"worst_index": [39, 7], "shard": {"tp": 1, "gtp": 1}})
    assert [(b.col0, b.col1, b.row0, b.row1) for b in pic.blocks][-1] == (4, 8, 24, 48)
    assert [b.marked for b in pic.blocks] == [False, False, False, True] and pic.worst == (39, 7)


def test_heatmap_groups_layers_kinds_steps():
    rows = synthetic.results(fail=True)
    hm = model.heatmap(rows)
    assert hm.layers == ["layer 0", "layer 1", "output"]
    assert hm.groups == ["activation", "grad", "param"]
    assert hm.steps == [0, 1, 2]
    cell = hm.cells[("output", "grad", 1)]
    assert (cell.failed, cell.count, cell.worst) == (1, 1, "output_layer.weight")
    assert hm.unit == "golden" and cell.value == pytest.approx(0.07 / 1e-8)  # candidate vs reference error
    assert hm.cells[("layer 1", "activation", 2)].failed == 0
    assert hm.cells[("layer 1", "activation", 2)].value == pytest.approx(1.0)
    assert ("output", "param", 0) in hm.cells and hm.cells[("output", "param", 0)].value == 0.0
    no_golden = [{**r, "ref_err_golden": None, "cand_err_golden": None} for r in rows]
    hm = model.heatmap(no_golden)  # without a golden: relative L2 in units of the dtype's eps
    assert hm.unit == "eps" and hm.cells[("output", "grad", 1)].value == pytest.approx(1.0 / 2**-23)


def test_drift_takes_the_worst_tensor_per_step():
    d = model.drift(synthetic.results(fail=True))
    assert d["candidate vs golden"] == [(0.0, 0.0), (1.0, 0.07), (2.0, 0.07)]
    assert d["reference vs golden"] == [(0.0, 0.0), (1.0, 1e-8), (2.0, 1e-8)]


def test_divergence_line_is_one_line(run):
    doc = json.loads((run / "summary.json").read_text())
    lines = {s["scenario"]: model.divergence_line(s) for s in doc["scenarios"]}
    assert lines["tp1-fp32"] == "tp1-fp32: parity holds"
    assert lines["tp1-bf16"].startswith(
        "tp1-bf16: first divergence at step 1 backward main_grad "
        "output_layer.weight on ranks [0] [rows 0-48 (GTP block 0)"
    )
    assert "ratio-G" in lines["tp1-bf16"] and "max_rel 1" in lines["tp1-bf16"]
    assert lines["tp2-fp32"].startswith("tp2-fp32: run failed: candidate: rank 1 exited")
    assert all("\n" not in line for line in lines.values())


def test_scenario_page_alone(run, tmp_path):
    out = write_scenario_page(run / "scenarios" / "tp1-fp32", tmp_path / "deep" / "p.html")
    html = out.read_text()
    assert (
        'class="verdict pass"' in html
        and "PASS: all 13 comparisons hold under the noise-floor policy" in html
    )


def _edit_steps(path: Path, side: str, step: int, column: str, value: float) -> None:
    rows = list(csv.DictReader(path.open()))
    for r in rows:
        if r["side"] == side and int(r["step"]) == step:
            r[column] = repr(value)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_baseline_round_trip_and_differences(tmp_path):
    run = synthetic.write_run(tmp_path / "run", SPECS[:2])
    base = update_baseline(run, tmp_path / "baseline")
    doc = json.loads((base / "tp1-bf16.json").read_text())
    assert doc["verdict"] == "fail" and len(doc["steps"]) == 6
    assert doc["provenance"]["versions"]["candidate"]["megatron-core"] == "0.19.2"
    assert re.fullmatch(r"[0-9a-f]{16}", doc["provenance"]["config_hash"]) and doc["provenance"]["date"]
    assert compare_to_baseline(run, base) == []

    steps = run / "scenarios" / "tp1-fp32" / "steps.csv"
    _edit_steps(steps, "candidate", 2, "reduced_loss", 4.2614 * (1 + 1e-7))  # within fp32 tolerance
    assert compare_to_baseline(run, base) == []
    _edit_steps(steps, "candidate", 2, "reduced_loss", 4.2714)
    msgs = compare_to_baseline(run, base)
    assert len(msgs) == 1 and msgs[0].startswith("tp1-fp32: candidate step 2 reduced_loss 4.2614 -> 4.2714")

    summary = run / "scenarios" / "tp1-fp32" / "summary.json"
    s = json.loads(summary.read_text())
    summary.write_text(json.dumps({**s, "verdict": "fail", "policy": {**s["policy"], "k": 8.0}}))
    msgs = compare_to_baseline(run, base)
    assert "tp1-fp32: verdict pass in the baseline, fail now" in msgs
    assert any("configuration changed" in m for m in msgs)

    (base / "tp1-bf16.json").unlink()
    (base / "gone.json").write_text("{}")
    msgs = compare_to_baseline(run, base)
    assert any(m.startswith("tp1-bf16: no baseline") for m in msgs)
    assert "gone: in the baseline but not in this run" in msgs


def test_grid_rows_first_axis_columns_the_others():
    from harness.report.index import IndexCell, grid

    topologies, precisions, optimizers = ("tp1-gtp2", "tp2-gtp2"), ("fp32", "bf16"), ("adam", "sgd")
    combos = [(t, p, o) for t in topologies for p in precisions for o in optimizers]
    cells = [IndexCell(f"{t}-{p}-{o}", "pass", "", "", {"topology": t, "precision": p, "optimizer": o}, "")
             for t, p, o in combos]
    corner, rows, cols, table = grid(cells)
    assert corner == "topology \\ precision \u00b7 optimizer"
    assert rows == ["tp1-gtp2", "tp2-gtp2"]
    assert cols == ["fp32 \u00b7 adam", "fp32 \u00b7 sgd", "bf16 \u00b7 adam", "bf16 \u00b7 sgd"]
    assert [c.name for c in table[("tp2-gtp2", "bf16 \u00b7 sgd")]] == ["tp2-gtp2-bf16-sgd"]
    one_axis = [IndexCell(n, "pass", "", "", {"fault": f}, "") for n, f in (("a", "x"), ("b", "y"))]
    corner, rows, cols, _ = grid(one_axis)
    assert (corner, rows, cols) == ("fault", ["x", "y"], ["verdict"])
    # A scenario whose run failed is summarized without axes: it gets a row of its own.
    corner, rows, cols, table = grid([*cells, IndexCell("crashed", "error", "", "", {}, "")])
    assert rows[-1] == "crashed" and table[("crashed", cols[0])][0].verdict == "error" and len(cols) == 4


def test_a_moved_run_folder_reads_its_own_traces(run, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(run, moved)
    manifest = moved / "traces" / "candidate-gtp2" / "manifest.json"
    manifest.write_text(manifest.read_text().replace("0.19.2", "9.9.9"))
    data = model.load_scenario(moved / "scenarios" / "tp1-bf16")
    assert data.trace_dirs["candidate"] == moved / "traces" / "candidate-gtp2"
    assert data.manifests["candidate"]["versions"]["megatron-core"] == "9.9.9"


def test_index_says_which_paths_each_scenario_exercised():
    """A side's megatron-core paths off the plainest one reach the summary's config and the
    index's listing, escaped; a plain side lists none."""
    import dataclasses

    from harness import scenario
    from harness.report.index import IndexCell, paths_line, render_index
    from harness.compare.outcome import scenario_config as _config

    (plain,) = scenario.load(Path(__file__).parent / "assets" / "tiny.toml")
    assert plain.candidate.paths() == {} and _config(plain)["paths"] == {}
    cand = dataclasses.replace(plain.candidate, distributed_optimizer=True, overlap_grad_reduce=True,
                               bucket_size=4000)
    s = dataclasses.replace(plain, candidate=cand)
    config = _config(s)
    assert config["paths"] == {"candidate": {"overlap_grad_reduce": True, "bucket_size": 4000,
                                             "distributed_optimizer": True}}
    line = paths_line({"config": config})
    assert line == "candidate: overlap_grad_reduce=True, bucket_size=4000, distributed_optimizer=True"
    html = render_index("t", [IndexCell("s", "pass", "", "", {}, "", paths="<x>")], "pass")
    assert "paths exercised" in html and "&lt;x&gt;" in html and "<x>" not in html
