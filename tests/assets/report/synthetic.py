"""Small synthetic run folders, shaped as ``gtp-parity run`` writes them, for report and plugin tests.

``write_run(run_dir, specs)`` writes ``summary.json``, ``scenarios/<name>/{summary.json,
steps.csv,results.csv}`` and one trace folder per side (manifest plus a rank index holding the
layout of the sharded weight). ``fake_run_scenarios`` stands in for
``harness.session.run_scenarios``: it fails a scenario whose candidate has a planted fault or
GTP 2 in a scenario named ``*fail*``, and records which process ran it.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

COLUMNS = [
    "step",
    "kind",
    "tensor",
    "passed",
    "policy",
    "bound",
    "dtype",
    "shape",
    "sample_ids",
    "numel",
    "bitwise_equal",
    "max_abs",
    "max_rel",
    "worst_index",
    "max_ulp",
    "p99_ulp",
    "rel_l2",
    "cosine",
    "mismatched",
    "ref_err_golden",
    "cand_err_golden",
    "ref_value",
    "cand_value",
    "golden_value",
    "phase",
]
WEIGHT = "output_layer.weight"
LAYOUT = {
    "logical_shape": [72, 64],
    "mesh": {"dp": 1, "gtp": 2, "tp": 1},
    "pads": {"gtp": 24},
    "placements": {"gtp": "S(0)"},
}
VERSIONS = {"python": "3.12.1", "torch": "2.14.1", "megatron-core": "0.19.2", "transformer-engine": None}


def _row(step, kind, tensor, passed=True, rel=1e-7, phase="backward", dtype="float32", **extra):
    row = {
        "step": step,
        "kind": kind,
        "tensor": tensor,
        "passed": passed,
        "policy": "noise-floor",
        "bound": 1e-6,
        "dtype": dtype,
        "shape": "[72, 64]",
        "numel": 4608,
        "bitwise_equal": False,
        "max_abs": rel * 0.1,
        "max_rel": rel,
        "worst_index": "[24, 58]",
        "max_ulp": 3.0,
        "p99_ulp": 1.0,
        "rel_l2": rel,
        "cosine": 1.0,
        "mismatched": 0.0 if passed else 4608.0,
        "ref_err_golden": 1e-8,
        "cand_err_golden": 1e-8 if passed else 0.07,
        "phase": phase,
    }
    return {**row, **extra}


def results(fail: bool, odd_name: str | None = None) -> list[dict]:
    rows = [_row(0, "param", WEIGHT, rel=0.0, phase="optimizer", cand_err_golden=0.0, ref_err_golden=0.0)]
    for step in (1, 2):
        rows += [
            _row(step, "activation", "decoder.layers.0.mlp", phase="forward"),
            _row(step, "activation", "decoder.layers.1.mlp", phase="forward", rel=2e-7),
            _row(step, "main_grad", WEIGHT, passed=not fail, rel=1.0 if fail else 1e-7),
            _row(step, "main_grad", "decoder.layers.0.mlp.linear_fc1.weight"),
            _row(step, "param", WEIGHT, phase="optimizer", passed=not fail, rel=0.5 if fail else 1e-7),
            _row(
                step,
                "scalar",
                "reduced_loss",
                phase="loss",
                ref_value=4.28,
                cand_value=4.28,
                golden_value=4.28,
            ),
        ]
    if odd_name:
        rows.append(_row(1, "activation", odd_name, phase="forward"))
    return rows


def steps(shift: float = 0.0) -> list[dict]:
    out = []
    for side in ("reference", "candidate", "golden"):
        for step, loss, gn in ((1, 4.2836, 1.6723), (2, 4.2614, 1.7386)):
            out.append(
                {
                    "side": side,
                    "step": step,
                    "reduced_loss": loss + (shift if side == "candidate" else 0.0),
                    "grad_norm": gn,
                    "lr": 0.05,
                    "lr_logged": 0.05,
                    "num_zeros": 0.0,
                    "skipped": 0.0,
                }
            )
    return out


def _csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def _trace(run_dir: Path, role: str, gtp: int) -> str:
    folder = run_dir / "traces" / f"{role}-gtp{gtp}"
    (folder / "rank0").mkdir(parents=True, exist_ok=True)
    manifest = {
        "format": "gtp-parity-trace",
        "version": 1,
        "complete": True,
        "world_size": 2,
        "key": f"{role}{gtp}-key",
        "side": f"megatron-w2-tp1-gtp{gtp}-fp32",
        "versions": VERSIONS,
        "mesh": {"tp": 1, "gtp": gtp, "dp": 2 // gtp},
        "coords": {
            "0": {"tp": 0, "gtp": 0, "dp": 0, "data": 0},
            "1": {"tp": 0, "gtp": 1 % gtp, "dp": 1 // gtp, "data": 1},
        },
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    layout = LAYOUT if gtp > 1 else {**LAYOUT, "pads": {}, "placements": {"tp": "R"}}
    entries = [
        {
            "step": s,
            "kind": k,
            "name": WEIGHT,
            "key": f"{k}|{WEIGHT}",
            "dtype": "torch.float32",
            "local_shape": [48, 64] if gtp > 1 else [72, 64],
            "layout": layout,
        }
        for s in (1, 2)
        for k in ("main_grad", "param")
    ]
    (folder / "rank0" / "index.json").write_text(json.dumps({"rank": 0, "tensors": entries, "scalars": []}))
    return str(folder)


def scenario_summary(run_dir: Path, name: str, verdict: str, axes: dict, tensor: str = WEIGHT) -> dict:
    traces = {
        "reference": _trace(run_dir, "reference", 1),
        "candidate": _trace(run_dir, "candidate", 2),
        "golden": _trace(run_dir, "golden", 1),
    }
    doc = {"scenario": name, "verdict": verdict, "traces": traces, "axes": axes}
    if verdict == "error":
        return {**doc, "error": {"candidate": "rank 1 exited with code 1 at step 2\x07 (see launch log)"}}
    fd = None
    if verdict == "fail":
        fd = {
            "step": 1,
            "phase": "backward",
            "kind": "main_grad",
            "tensor": tensor,
            "ranks": [0],
            "region": {"gtp_block_rows": [0, 48], "ranks": [0], "shard": {"gtp": 0}, "worst_index": [24, 58]},
            "signature": "ratio-G",
            "explanation": "candidate = G x reference: a mean over the GTP group became a sum (missing 1/G)",
            "metrics": {"max_abs": 0.075, "max_rel": 1.0, "bound": 6e-8},
        }
    return {
        **doc,
        "first_divergence": fd,
        "checked": {"main_grad": 4, "param": 3, "activation": 4, "scalar": 2},
        "failing": 4 if fd else 0,
        "policy": {"name": "noise-floor", "k": 4.0, "floor": 0.0},
        "invariants": {"replica": [], "padding": []},
        "config": {
            "source": "tests/assets/synthetic.toml",
            "description": "synthetic",
            "reference": "megatron-w2-tp1-gtpoff-fp32",
            "candidate": "megatron-w2-tp1-gtp2-fp32",
            "golden": "torch-w1-tp1-gtpoff-fp64",
        },
    }


def write_run(run_dir: Path, specs: list[dict]) -> Path:
    """specs: [{"name", "verdict", "axes"?, "tensor"?, "odd_name"?, "shift"?}] -> a run folder."""
    run_dir = Path(run_dir)
    docs = []
    for spec in specs:
        sdir = run_dir / "scenarios" / spec["name"]
        sdir.mkdir(parents=True, exist_ok=True)
        doc = scenario_summary(
            run_dir, spec["name"], spec["verdict"], spec.get("axes", {}), spec.get("tensor", WEIGHT)
        )
        (sdir / "summary.json").write_text(json.dumps(doc))
        if spec["verdict"] != "error":
            rows = results(spec["verdict"] == "fail", spec.get("odd_name"))
            if spec.get("tensor"):
                rows = [{**r, "tensor": spec["tensor"]} if r["tensor"] == WEIGHT else r for r in rows]
            _csv(sdir / "results.csv", rows, COLUMNS)
            _csv(sdir / "steps.csv", steps(spec.get("shift", 0.0)), list(steps()[0]))
        docs.append(doc)
    verdicts = {d["verdict"] for d in docs}
    overall = "error" if "error" in verdicts else "fail" if "fail" in verdicts else "pass"
    (run_dir / "summary.json").write_text(json.dumps({"scenarios": docs, "verdict": overall}))
    return run_dir


def fake_run_scenarios(scenarios, out, parallel=2, verbose=False) -> int:
    """Stands in for harness.session.run_scenarios without launching anything."""
    out = Path(out)
    specs = []
    for s in scenarios:
        failing = bool(s.candidate.inject) or ("fail" in s.name and s.candidate.gtp > 1)
        specs.append({"name": s.name, "verdict": "fail" if failing else "pass", "axes": dict(s.axes)})
    write_run(out, specs)
    log = os.environ.get("FAKE_RUN_LOG")
    if log:
        with open(log, "a") as f:
            f.write(
                json.dumps(
                    {
                        "rank": os.environ.get("RANK"),
                        "pid": os.getpid(),
                        "out": str(out),
                        "names": [s.name for s in scenarios],
                    }
                )
                + "\n"
            )
    return 1 if any(sp["verdict"] == "fail" for sp in specs) else 0
