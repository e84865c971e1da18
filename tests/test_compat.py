"""The CPU compatibility layer: its collectives match torch.distributed's, the mapping of
samples to ranks matches megatron-core's groups, and it refuses an unknown megatron-core."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import MAIN_TREE, needs_repositories

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("compat") / "report"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
         str(ROOT / "tests/multirank/compat_check.py"), str(out)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.multirank
def test_collective_stand_ins_match_torch_distributed(reports):
    for rep in reports:
        failed = [k for k, ok in rep["checks"].items() if not ok]
        assert not failed, f"rank {rep['rank']}: {failed}"
    assert "gather-pair" in reports[0]["checks"] and "gather-pair" not in reports[2]["checks"]


@pytest.mark.multirank
def test_gtp_collectives_of_a_group_complete_in_issue_order(reports):
    # Two async gathers (and reduce-scatters) into one buffer: the later one wins, as on a CUDA
    # stream. Gloo by itself lets them finish in either order in a few percent of the rounds.
    for rep in reports:
        checks = {k: ok for k, ok in rep["checks"].items() if k.startswith("issue-order-")}
        assert checks and all(checks.values()), f"rank {rep['rank']}: {checks}"


@pytest.mark.multirank
def test_lagging_collectives_land_only_when_waited(reports):
    # gtp_collectives = "lagging": what a read that skips its wait sees is the buffer's previous
    # content, every time (the planted gtp-prefetch-missing-wait relies on it).
    for rep in reports:
        checks = {k: ok for k, ok in rep["checks"].items() if k.startswith("lagging-")}
        assert checks and all(checks.values()), f"rank {rep['rank']}: {checks}"


@pytest.mark.multirank
def test_ddp_coalesced_all_gathers_land_at_the_wait(reports):
    # DDP's param all-gathers (distributed optimizer, overlap_param_gather): a read that skips
    # the bucket's wait sees the old values every time, not whenever gloo's thread finished
    # (gtp_paths' overlap-param-gather-prefetch-on relies on it).
    for rep in reports:
        checks = {k: ok for k, ok in rep["checks"].items() if k.startswith("ddp-coalesced-")}
        assert checks and all(checks.values()), f"rank {rep['rank']}: {checks}"


@pytest.mark.multirank
@pytest.mark.parametrize("key, expected", [
    # rank = tp + TP * (g + G * dp); data rank = rank // TP; data rank d reads [d*mbs, (d+1)*mbs).
    ("tp2-gtp2-dp1",
     [[[0], [2], [4], [6]], [[0], [2], [4], [6]], [[1], [3], [5], [7]], [[1], [3], [5], [7]]]),
    ("tp1-gtp2-dp2", [[[0], [4]], [[1], [5]], [[2], [6]], [[3], [7]]]),
])
def test_sample_to_rank_mapping(reports, key, expected):
    assert [rep[f"samples-{key}"] for rep in reports] == expected


def test_version_guard_reads_the_imported_tree_not_the_wheels_metadata(monkeypatch):
    from megatron.core import package_info

    from harness.backends.megatron import compat

    monkeypatch.setattr(package_info, "__version__", "0.18.0")
    with pytest.warns(UserWarning,
                      match=r"read against megatron-core \['0.19.2', '0.20.0'\], this tree is 0.18.0"):
        assert compat.check_version() == "0.18.0"


@pytest.mark.slow
def test_inactive_when_cuda_is_available():
    code = ("import torch; torch.cuda.is_available = lambda: True\n"
            "from harness.backends.megatron import compat\n"
            "assert compat.install() is False and torch.cuda.Event is not compat._Event")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})


# Megatron-LM main's tree, for the stand-ins main needs beyond the wheel (a git:REPO@REV spec or
# a folder; the default is the local mirror where there is one).

# Imports GTP through the compat layer and prints what GTP's recompute-phase test answers and which
# of its module-level names are still TE's absent-module stubs (MagicMock) after install.
_PROBE = """
import json
import unittest.mock
import torch
from harness.backends.megatron import compat
compat.install()
from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp
names = ("in_fp8_activation_recompute_phase", "in_activation_recompute_phase")
answers = {n: repr(getattr(gtp, n)()) for n in names if hasattr(gtp, n)}
stubs = sorted(n for n, v in vars(gtp).items() if isinstance(v, unittest.mock.MagicMock))
print(json.dumps({"version": compat.tree_version(), "answers": answers, "stubs": stubs}))
"""


def _tree_root(spec: str, tmp_path: Path) -> Path | None:
    from harness.run import trees

    if spec == "installed":
        return None
    if spec == "wheel-with-main-alias":
        # The wheel with main's alias (gtp.py l.110 on main): CI has no Megatron-LM checkout.
        shutil.copytree(trees.installed_root() / "megatron", tmp_path / "megatron",
                        ignore=shutil.ignore_patterns("__pycache__"))
        gtp = tmp_path / "megatron/core/tensor_parallel/generalized_tensor_parallelism.py"
        gtp.write_text(gtp.read_text() + "\nin_activation_recompute_phase = "
                                         "in_fp8_activation_recompute_phase\n")
        return tmp_path

    needs_repositories(spec)
    return Path(trees.resolve(spec, "test").root)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["installed", "wheel-with-main-alias", MAIN_TREE],
                         ids=["wheel", "wheel-with-main-alias", "main"])
def test_gtp_runs_outside_te_recompute_phase_on_every_tree(spec, tmp_path):
    # main binds TE's in_fp8_activation_recompute_phase once more at import, as
    # in_activation_recompute_phase, and calls only that name: without TE it is a MagicMock whose
    # call is truthy, so with only the TE name answered every gather was taken for a recompute's
    # (the forward left its prefetch chain, and _all_gather_weight skipped ensure_params_ready,
    # main's fix for overlap_param_gather). Both names must answer False, and no name GTP calls
    # may be left a stub.
    root = _tree_root(spec, tmp_path)
    path = os.pathsep.join(str(p) for p in (root, ROOT) if p is not None)
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, timeout=240, capture_output=True,
                          text=True,
                          env={**os.environ, "PYTHONPATH": path, "PYTHONSAFEPATH": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    assert probe["answers"] and set(probe["answers"].values()) == {"False"}, probe
    # te/tex are module handles read only on quantized paths; everything else must be replaced.
    assert set(probe["stubs"]) <= {"te", "tex"}, probe
    if root is not None:
        assert "in_activation_recompute_phase" in probe["answers"], probe
    if spec == MAIN_TREE:
        assert probe["version"] == "0.20.0", probe
