"""Traces: the capture API from a plain loop, atomic files, and clear errors for bad traces."""

import json
import pickle
import shutil

import pytest
import torch

from harness import cli, trace
from harness.assemble import assemble_trace
from harness.capture import Capture
from harness.errors import BadInput
from harness.layout import Layout, replicated
from harness.scenario import CapturePolicy


def plain_loop_trace(path, policy=CapturePolicy(), width=3):
    """A user's own single-process loop captured in a few lines."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cap = Capture(path, rank=0, world_size=1, coord={"tp": 0, "gtp": 0, "dp": 0}, mesh={}, policy=policy)
    cap.attach({"0": model[0], "1": model[1]})
    layout = lambda name, p: replicated(tuple(p.shape))  # noqa: E731
    for step in (1, 2):
        cap.begin_step(step)
        ids = [2 * step, 2 * step + 1]
        cap.micro_batch(0, ids)
        x = torch.randn(1, 2, 4)  # [s, b, h]
        loss = model(x).pow(2).mean()
        loss.backward()
        cap.params("main_grad", model.named_parameters(), layout, value=lambda p: p.grad)
        opt.step()
        opt.zero_grad()
        cap.params("param", model.named_parameters(), layout)
        cap.scalar("reduced_loss", loss.item())
        cap.end_step()
    cap.close()
    Capture.finalize(path, world_size=1, coords={0: {"tp": 0, "gtp": 0, "dp": 0}}, mesh={})
    return model


def test_capture_api_round_trip(tmp_path):
    model = plain_loop_trace(tmp_path / "t")
    t = trace.read(tmp_path / "t")
    logical = assemble_trace(t)
    assert torch.equal(logical.tensors[(2, "param", "1.weight")], model[1].weight.detach())
    acts = logical.samples[(2, "activation", "1")]
    assert sorted(acts) == [4, 5] and acts[4].shape == (1, 2)  # stored [b, s, ...] per sample
    assert {s["name"] for s in t.scalars} == {"reduced_loss"}
    assert t.manifest["versions"]["torch"] == torch.__version__.split("+")[0] or t.manifest["versions"]["torch"]


def test_fingerprint_mode_stores_no_tensors(tmp_path):
    plain_loop_trace(tmp_path / "t", CapturePolicy(mode="fingerprint"))
    t = trace.read(tmp_path / "t")
    fps = [e.fingerprint for e in t.entries if e.kind == "param"]
    assert fps and all(len(fp["sha256"]) == 64 and fp["blocks"] for fp in fps)
    assert not list((tmp_path / "t" / "rank0").glob("step1.safetensors")) or all(
        e.kind == "input" for e in t.entries if e.fingerprint is None)


def test_incomplete_trace_is_recognised(tmp_path):
    plain_loop_trace(tmp_path / "t")
    (tmp_path / "t" / "manifest.json").unlink()
    with pytest.raises(BadInput, match="incomplete"):
        trace.read(tmp_path / "t")
    assert not trace.read(tmp_path / "t", allow_incomplete=True).complete


@pytest.fixture
def good(tmp_path):
    plain_loop_trace(tmp_path / "good")
    return tmp_path / "good"


def corrupt(good, tmp_path, how):
    bad = tmp_path / f"bad-{how}"
    shutil.copytree(good, bad)
    if how == "missing-rank":
        shutil.rmtree(bad / "rank0")
    elif how == "truncated":
        f = bad / "rank0" / "step1.safetensors"
        f.write_bytes(f.read_bytes()[:50])
    elif how == "shape":
        idx = json.loads((bad / "rank0" / "index.json").read_text())
        for e in idx["tensors"]:
            if e["kind"] == "param":
                e["local_shape"] = [99, 99]
        (bad / "rank0" / "index.json").write_text(json.dumps(idx))
    elif how == "version":
        m = json.loads((bad / "manifest.json").read_text())
        m["version"] = 99
        (bad / "manifest.json").write_text(json.dumps(m))
    elif how == "json":
        (bad / "manifest.json").write_text("{not json")
    return bad


@pytest.mark.parametrize("how, names, says", [
    ("missing-rank", "rank0/index.json", "missing index of rank 0"),
    ("truncated", "step1.safetensors", "corrupt or truncated"),
    ("shape", "index.json", "does not match its layout"),
    ("version", "manifest.json", "unknown trace format version 99"),
    ("json", "manifest.json", "invalid JSON"),
])
def test_bad_traces_exit_2_naming_the_file(good, tmp_path, capsys, how, names, says):
    bad = corrupt(good, tmp_path, how)
    code = cli.main(["compare", str(good), str(bad), "--out", str(tmp_path / "cmp")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert names in err and says in err


def test_a_pickle_in_a_trace_is_never_executed(good, tmp_path, capsys):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    bad = tmp_path / "pickled"
    shutil.copytree(good, bad)
    (bad / "rank0" / "step1.safetensors").write_bytes(pickle.dumps(Payload()))
    assert cli.main(["compare", str(good), str(bad), "--out", str(tmp_path / "cmp")]) == 2
    assert not marker.exists()
    assert "corrupt or truncated" in capsys.readouterr().err


def test_identical_traces_compare_equal(good, tmp_path):
    assert cli.main(["compare", str(good), str(good), "--out", str(tmp_path / "cmp")]) == 0
    summary = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert summary["verdict"] == "pass" and summary["checked"]["param"] == 8


def test_compare_judges_under_the_policy_given(good, tmp_path):
    args = ["--policy", "exact", "--k", "2", "--k-first-step", "1.5", "--floor", "0"]
    assert cli.main(["compare", str(good), str(good), "--out", str(tmp_path / "cmp"), *args]) == 0
    summary = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert summary["policy"] == {"name": "exact", "k": 2.0, "k_first_step": 1.5, "floor": 0.0}


def test_layout_of_activation_is_per_sample(good):
    entry = next(e for e in trace.read(good).entries if e.kind == "activation")
    assert isinstance(entry.layout, Layout) and entry.sample_ids == (2, 3)


def test_fingerprint_traces_compare_by_hash_and_name_the_block(tmp_path):
    plain_loop_trace(tmp_path / "a", CapturePolicy(mode="fingerprint"))
    plain_loop_trace(tmp_path / "b", CapturePolicy(mode="fingerprint"))
    idx_path = tmp_path / "b" / "rank0" / "index.json"
    idx = json.loads(idx_path.read_text())
    for e in idx["tensors"]:
        if e["kind"] == "param" and e["name"] == "0.weight" and e["step"] == 2:
            e["fingerprint"]["sha256"] = "0" * 64
            e["fingerprint"]["blocks"][1]["crc32"] = "f" * 8
    idx_path.write_text(json.dumps(idx))
    from harness.compare import compare

    summary = compare({"reference": trace.read(tmp_path / "a"), "candidate": trace.read(tmp_path / "b")})
    df = summary["results"]
    fp = df[df["policy"] == "fingerprint"]
    assert len(fp) > 0 and (~fp["passed"]).sum() == 1
    bad = fp[~fp["passed"]].iloc[0]
    assert bad["tensor"] == "0.weight" and bad["differing_blocks"] == {"0": [1]}
    assert summary["first_divergence"]["tensor"] == "0.weight"


def test_tensors_swapped_inside_a_file_are_refused(tmp_path, capsys):
    """Two same-shaped tensors swapped in a safetensors file pass every shape check; the
    content hash recorded at capture names the altered tensor."""
    from safetensors.torch import load_file, save_file

    plain_loop_trace(tmp_path / "t")
    path = tmp_path / "t" / "rank0" / "step1.safetensors"
    tensors = load_file(str(path))
    a, b = "param|0.bias", "main_grad|0.bias"
    assert tensors[a].shape == tensors[b].shape and not torch.equal(tensors[a], tensors[b])
    tensors[a], tensors[b] = tensors[b], tensors[a]
    save_file(tensors, str(path))
    t = trace.read(tmp_path / "t")
    entry = next(e for e in t.entries if e.key == a and e.step == 1)
    with pytest.raises(BadInput, match="param\\|0.bias.*content hash"):
        t.tensor(entry)
    assert torch.equal(trace.read(tmp_path / "t", verify=False).tensor(entry), tensors[a])  # opt-out
    code = cli.main(["compare", str(tmp_path / "t"), str(tmp_path / "t"), "--out", str(tmp_path / "cmp")])
    assert code == 2 and "content hash" in capsys.readouterr().err
    # Found by a worker process of --jobs 2: the same one-line bad input, nothing written.
    code = cli.main(["compare", str(tmp_path / "t"), str(tmp_path / "t"), "--out", str(tmp_path / "jobs"), "--jobs", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "|0.bias" in err and "content hash" in err
    assert not (tmp_path / "jobs" / "summary.json").exists()


def test_comparing_two_models_is_a_bad_input(tmp_path, capsys):
    plain_loop_trace(tmp_path / "a")
    plain_loop_trace(tmp_path / "b", width=5)
    code = cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "not the same model" in err and "0.bias" in err and "[5]" in err and "[3]" in err
