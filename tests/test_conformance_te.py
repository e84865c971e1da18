"""The conformance kit and Transformer Engine's own ``distributed_weight.py``: fetching, verifying
and loading the pinned file, the dispatcher contract, driving clauses through TE's code, and the
report. Everything here runs offline; the tests that need the real file skip, with the reason,
only where set-up could not fetch it (``GTP_PARITY_REQUIRE_TE_FILE=1`` makes that a failure).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from harness.conformance import cli, layout, te_contract, te_source
from harness.conformance.clauses import check_capability_marker
from harness.conformance.drive import Case, Observation, _capability, _passthrough_problems, drive
from harness.conformance.protocol import KIT_DISPATCH, select_dispatch
from harness.conformance.reference import reference
from harness.conformance.registry import CLAUSES, TRACE_CLAUSES
from harness.conformance.kit import ClauseRecord, ConformanceResult, format_table

REQUIRE = "GTP_PARITY_REQUIRE_TE_FILE"
REPO = Path(__file__).resolve().parents[1]
REFERENCE = "harness.conformance.reference:reference"
ORIGINAL_DOWNLOAD = te_source._download


def te_file_or_skip() -> te_source.TESource:
    """The real cached file; skip (fail under GTP_PARITY_REQUIRE_TE_FILE) when set-up lacks it."""
    try:
        return te_source.cached()
    except te_source.Unavailable as exc:
        reason = (
            f"TE {te_source.TE_VERSION}'s distributed_weight.py is not cached ({exc}); "
            f"scripts/setup.sh fetches it"
        )
        if os.environ.get(REQUIRE):
            pytest.fail(f"{REQUIRE} is set: {reason}")
        pytest.skip(reason)


# --- fetching and verifying (synthetic wheels, no network) -----------------------------------

FAKE_SOURCE = b"import torch\n\nVALUE = 42\n"
FAKE_LICENSE = b"Apache License\nVersion 2.0, January 2004\n"


def _wheel_bytes(source: bytes = FAKE_SOURCE) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr(te_source.MEMBER, source)
        archive.writestr(te_source.LICENSE_MEMBER, FAKE_LICENSE)
        archive.writestr("transformer_engine/__init__.py", b"raise RuntimeError('never imported')\n")
    return buf.getvalue()


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    """A private XDG cache and no network: any download attempt fails the test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))

    def no_network(dest):
        raise AssertionError("te_source tried to download")

    monkeypatch.setattr(te_source, "_download", no_network)
    return tmp_path / "xdg" / "gtp-parity" / "transformer-engine"


@pytest.fixture
def pinned_fake(tmp_path, monkeypatch, empty_cache) -> Path:
    """A synthetic wheel with the pins moved to its own hashes."""
    data = _wheel_bytes()
    wheel = tmp_path / te_source.WHEEL
    wheel.write_bytes(data)
    monkeypatch.setattr(te_source, "WHEEL_SHA256", te_source._sha256(data))
    monkeypatch.setattr(te_source, "FILE_SHA256", te_source._sha256(FAKE_SOURCE))
    return wheel


def test_fetch_extracts_one_file_with_its_license_and_is_offline_once_cached(
    pinned_fake, empty_cache, capsys
):
    source = te_source.fetch(pinned_fake)
    folder = empty_cache / te_source.TE_VERSION
    assert source.path == folder / "distributed_weight.py"
    assert sorted(p.name for p in folder.iterdir()) == ["LICENSE", "SOURCE.json", "distributed_weight.py"]
    assert [p.name for p in empty_cache.iterdir()] == [te_source.TE_VERSION]  # no staging left
    assert (folder / "LICENSE").read_bytes() == FAKE_LICENSE
    provenance = json.loads((folder / "SOURCE.json").read_text())
    assert provenance["sha256"] == te_source.FILE_SHA256
    assert provenance["wheel_sha256"] == te_source.WHEEL_SHA256
    assert te_source.fetch() == source  # cached and verified: the no-network fixture holds
    assert te_source.main([]) == 0
    assert capsys.readouterr().out.startswith(f"TE {te_source.TE_VERSION} distributed_weight.py ")
    module, loaded = te_source.load()
    assert module.VALUE == 42 and module.__name__ == te_source.MODULE_NAME
    assert loaded == source and te_source.MODULE_NAME not in sys.modules


def test_a_wheel_with_another_hash_is_refused_and_nothing_is_cached(tmp_path, empty_cache, capsys):
    wheel = tmp_path / te_source.WHEEL
    wheel.write_bytes(_wheel_bytes())  # not the registry's wheel: its sha256 is not the pin
    assert te_source.main(["--wheel", str(wheel)]) == 2
    err = capsys.readouterr().err
    assert f"is pinned at {te_source.WHEEL_SHA256}; refusing it" in err
    assert not (empty_cache / te_source.TE_VERSION).exists()
    assert list(empty_cache.iterdir()) == []


def test_a_corrupted_cached_file_is_refused_everywhere(pinned_fake, capsys):
    source = te_source.fetch(pinned_fake)
    source.path.write_bytes(FAKE_SOURCE + b"VALUE = 0\n")
    for call in (te_source.cached, te_source.load, select_dispatch):
        with pytest.raises(te_source.Refused, match="refusing it"):
            call()
    assert te_source.main(["--check"]) == 2
    argv = ["--impl", REFERENCE, "--nproc", "2"]
    assert cli.main(argv) == 2  # auto does not fall back from a refused file
    assert "refusing it" in capsys.readouterr().err
    te_source.fetch(pinned_fake)  # fetching again replaces it with the verified file
    assert te_source.load()[0].VALUE == 42


def test_a_failed_download_leaves_the_kit_on_its_mirror_and_says_why(
    empty_cache, monkeypatch, capsys
):
    monkeypatch.setattr(te_source, "_download", ORIGINAL_DOWNLOAD)  # pip runs, and fails

    def failing_pip(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command
        return subprocess.CompletedProcess(command, 1, "", "ERROR: no route to the registry\n")

    monkeypatch.setattr(te_source.subprocess, "run", failing_pip)
    assert te_source.main([]) == 1
    err = capsys.readouterr().err
    assert "no route to the registry" in err and "will run on its own mirror" in err
    assert list(empty_cache.iterdir()) == []  # no half-written cache
    dispatch = select_dispatch("auto")
    assert dispatch.name == "kit" and "not available" in dispatch.note
    with pytest.raises(te_source.Unavailable, match="is absent"):
        select_dispatch("te")
    assert cli.main(["--impl", REFERENCE, "--nproc", "2", "--dispatch", "te"]) == 2
    assert "is absent" in capsys.readouterr().err


# --- the real file -----------------------------------------------------------------------------


def test_the_loaded_file_is_tes_pinned_release_and_stays_private():
    source = te_file_or_skip()
    module, loaded = te_source.load()
    assert loaded.label == f"TE 2.20.2 distributed_weight.py {te_source.FILE_SHA256}"
    assert source.path.stat().st_size == 4859
    assert "Apache License" in (source.path.parent / "LICENSE").read_text()
    assert set(module.__all__) >= {
        "DistributedWeight",
        "is_distributed_weight",
        "materialize_weight_for_forward",
        "materialize_weight_for_backward",
        "finalize_weight_grads",
    }
    dispatch = select_dispatch("auto")
    assert dispatch.name == "te" and dispatch.source == loaded.label and not dispatch.note
    for fn in (dispatch.materialize_for_forward, dispatch.finalize, dispatch.is_distributed_weight):
        assert fn.__module__ == te_source.MODULE_NAME
        assert fn.__code__.co_filename == str(source.path)
    assert not [name for name in sys.modules if name.split(".")[0] == "transformer_engine"]


@pytest.mark.slow
def test_megatron_core_imports_after_tes_file_is_loaded():
    te_file_or_skip()
    code = (
        "import sys; from harness.conformance.protocol import select_dispatch; "
        "assert select_dispatch('te').name == 'te'; import megatron.core; "
        "assert 'transformer_engine' not in sys.modules; print('ok')"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_tes_dispatchers_and_the_mirror_keep_the_contract_the_clauses_assume():
    assert te_contract.dispatch_problems(KIT_DISPATCH) == []
    assert _passthrough_problems(KIT_DISPATCH) == []
    te_file_or_skip()
    dispatch = select_dispatch("te")
    assert te_contract.dispatch_problems(dispatch) == []
    assert _passthrough_problems(dispatch) == []


# --- planted wrong dispatchers -----------------------------------------------------------------


def _first_only(weights):
    """The kit's earlier mirror: indexes weights[0] without wrapping a bare weight."""
    if KIT_DISPATCH.is_distributed_weight(weights[0]):
        out = weights[0].materialize_group_for_forward()
        return list(out) if isinstance(out, (list, tuple)) else [out]
    return list(weights)


def _every_member(weights):
    weights = weights if isinstance(weights, (list, tuple)) else [weights]
    for w in weights[1:]:
        w.materialize_group_for_backward()
    return KIT_DISPATCH.materialize_for_backward(weights)


def _always_a_list(weights, wgrads):
    weights = weights if isinstance(weights, (list, tuple)) else [weights]
    out = weights[0].finalize_group_grads(list(wgrads))
    return list(out) if isinstance(out, (list, tuple)) else [out]


@pytest.mark.parametrize(
    "field, planted, found",
    [
        ("materialize_for_forward", _first_only, "forward of a bare weight"),
        ("materialize_for_backward", _every_member, "not one leader call"),
        ("finalize", _always_a_list, "the leader was not handed the wgrad(s) as TE does"),
        ("is_distributed_weight", lambda w: bool(getattr(w, "is_distributed_weight", 0)), "TypeError"),
    ],
)
def test_a_planted_wrong_dispatcher_breaks_the_dispatch_contract(field, planted, found):
    problems = te_contract.dispatch_problems(replace(KIT_DISPATCH, **{field: planted}))
    assert any(found in p for p in problems), problems


@pytest.fixture
def world_of_one(tmp_path):
    """A one-rank gloo group in this process, torn down afterwards."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.new_group([0]), dist.new_group([0])
    finally:
        dist.destroy_process_group()


def _judge(dispatch, groups, case) -> dict[str, list]:
    tp_group, gtp_group = groups
    coords = layout.Coords(tp=1, gtp=1, dp=1, rank=0)
    trace = drive(
        reference, case, overlap=False, coords=coords, tp_group=tp_group, gtp_group=gtp_group,
        dispatch=dispatch,
    )
    assert trace.dispatch == dispatch.name
    return {name: check(trace) for name, check in TRACE_CLAUSES.items()}


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gloo's deprecated collective names
def test_a_planted_wrong_dispatcher_result_fails_the_clauses_tes_file_passes(world_of_one):
    te_file_or_skip()
    dispatch = select_dispatch("te")
    case = Case(tp=1, gtp=1, shapes=((8, 4), (8, 4)), group_size=2, pad_for_alignment=0)
    assert {name: f for name, f in _judge(dispatch, world_of_one, case).items() if f} == {}

    def swapped(weights):  # TE's result with the group's members in the wrong order
        return dispatch.materialize_for_forward(weights)[::-1]

    verdicts = _judge(replace(dispatch, materialize_for_forward=swapped), world_of_one, case)
    failed = {name for name, f in verdicts.items() if f}
    # The probes see the reversed lists too; the values clauses see the swapped members.
    values = {"forward.values", "forward.repeat", "forward.fresh_after_update"}
    assert failed == {"dispatch.contract", "capability.plain_passthrough", *values}


class _NoGradBuffer(torch.nn.Parameter):
    is_distributed_weight = True

    def materialize_group_for_forward(self):
        return self

    def materialize_group_for_backward(self):
        return self

    def finalize_group_grads(self, wgrads):
        return None


@pytest.mark.parametrize("which", ["kit", "te"])
def test_a_weight_lacking_a_protocol_method_fails_the_marker_clause(which):
    if which == "te":
        te_file_or_skip()
    dispatch = select_dispatch(which)
    weight = _NoGradBuffer(torch.zeros(2, 2))
    trace = Observation(
        case=Case(tp=1, gtp=2), overlap=False, coords=layout.Coords(1, 2, 1, 0), seed=0,
        dispatch=dispatch.name, capability=[_capability(weight, dispatch)],
    )
    failures = check_capability_marker(trace)
    assert [f.found for f in failures] == ["not a DistributedWeight: it lacks grad_buffer"]
    trace.capability = [_capability(te_contract._Probe("complete", []), dispatch)]
    assert check_capability_marker(trace) == []


# --- the report --------------------------------------------------------------------------------


def test_every_clause_has_a_route():
    assert set(te_contract.ROUTES) == set(CLAUSES)


def _table(dispatch: str, source: str, note: str = "") -> list[str]:
    records = [ClauseRecord(c, "tp1-gtp2/x", "overlap", "pass") for c in CLAUSES]
    result = ConformanceResult("m:f", dispatch, 2, ["1x2"], records, source, note)
    return format_table(ConformanceResult.from_json(result.to_json())).splitlines()


def test_the_report_names_tes_file_and_each_clauses_route():
    label = f"TE 2.20.2 distributed_weight.py {te_source.FILE_SHA256}"
    lines = _table("te", label)
    assert lines[1] == f"Dispatchers: {label}"
    routes = {line.split()[0]: line.split()[2] for line in lines if line.split()[:1] in (
        [c] for c in CLAUSES)}
    assert routes["forward.values"] == "te" and routes["finalize.in_place"] == "te"
    assert routes["layout.shard"] == routes["grad_buffer.spec"] == "direct"
    assert "TE's file was not driven" not in "\n".join(lines)
    assert "Not covered without TE's modules (CUDA and the TE torch extension):" in lines
    mirror = _table("kit", KIT_DISPATCH.source, "TE's file is not available (x)")
    assert mirror[1] == f"Dispatchers: {KIT_DISPATCH.source}"
    assert mirror[2] == "  TE's file is not available (x)"
    assert any("TE's file was not driven" in line for line in mirror)
    assert {line.split()[2] for line in mirror if line.split()[:1] == ["forward.values"]} == {"mirror"}
