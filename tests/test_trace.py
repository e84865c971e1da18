"""Traces: the capture API from a plain loop, atomic files, and clear errors for bad traces."""

import json
import pickle
import shutil

import pytest
import torch

from harness import cli
from harness.capture import trace
from harness.compare.assemble import assemble_trace
from harness.capture.api import Capture
from harness.common.errors import BadInput
from harness.common.layout import Layout, replicated
from harness.scenario.schema import CapturePolicy


def plain_loop_trace(path, policy=CapturePolicy(), width=3, poison=None):
    """A user's own single-process loop captured in a few lines; ``poison`` = (step, name): that
    gradient is NaN in every element."""
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
        for name, p in model.named_parameters():
            if poison == (step, name):
                p.grad.fill_(float("nan"))
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
    assert (t.manifest["versions"]["torch"] == torch.__version__.split("+")[0]
            or t.manifest["versions"]["torch"])


def test_fingerprint_mode_stores_no_tensors(tmp_path):
    plain_loop_trace(tmp_path / "t", CapturePolicy(mode="fingerprint"))
    t = trace.read(tmp_path / "t")
    fps = [e.fingerprint for e in t.entries if e.kind == "param"]
    assert fps and all(len(fp["xxh3_128"]) == 32 and fp["blocks"] and "xxh3_64" in fp["blocks"][0]
                       for fp in fps)
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


@pytest.mark.parametrize("whole,block", [("xxh3_128", "xxh3_64"), ("sha256", "crc32")])
def test_fingerprint_traces_compare_by_hash_and_name_the_block(tmp_path, monkeypatch, whole, block):
    """Today's digests, and those of traces fingerprinted before xxh3 (sha256 and CRC-32)."""
    from harness.capture import fingerprint as fingerprint_mod

    monkeypatch.setattr(fingerprint_mod, "WHOLE_DIGEST", whole)
    monkeypatch.setattr(fingerprint_mod, "BLOCK_DIGEST", block)
    plain_loop_trace(tmp_path / "a", CapturePolicy(mode="fingerprint"))
    plain_loop_trace(tmp_path / "b", CapturePolicy(mode="fingerprint"))
    idx_path = tmp_path / "b" / "rank0" / "index.json"
    idx = json.loads(idx_path.read_text())
    for e in idx["tensors"]:
        if e["kind"] == "param" and e["name"] == "0.weight" and e["step"] == 2:
            assert whole in e["fingerprint"] and block in e["fingerprint"]["blocks"][1]
            e["fingerprint"][whole] = "0" * 32
            e["fingerprint"]["blocks"][1][block] = "f" * 8
    idx_path.write_text(json.dumps(idx))
    from harness.compare.judge import compare

    summary, df = compare({"reference": trace.read(tmp_path / "a"), "candidate": trace.read(tmp_path / "b")})
    fp = df[df["policy"] == "fingerprint"]
    assert len(fp) > 0 and (~fp["passed"]).sum() == 1
    bad = fp[~fp["passed"]].iloc[0]
    assert bad["tensor"] == "0.weight" and bad["differing_blocks"] == {"0": [1]}
    assert summary.first_divergence.tensor == "0.weight"


@pytest.mark.slow
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
    code = cli.main(["compare", str(tmp_path / "t"), str(tmp_path / "t"), "--out", str(tmp_path / "jobs"),
                     "--jobs", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "|0.bias" in err and "content hash" in err
    assert not (tmp_path / "jobs" / "summary.json").exists()


def test_traces_recorded_with_sha256_still_verify(tmp_path):
    """An index written before the digest was named holds ``sha256`` per tensor: read as such."""
    plain_loop_trace(tmp_path / "t")
    assert {e.digest_alg for e in trace.read(tmp_path / "t").entries if e.digest} == {trace.DIGEST}
    idx_path = tmp_path / "t" / "rank0" / "index.json"
    idx = json.loads(idx_path.read_text())
    t = trace.read(tmp_path / "t")
    for e, entry in zip(idx["tensors"], t.entries):
        if e.pop("digest_alg") and e.pop("digest"):
            e["sha256"] = trace.content_hash(t.tensor(entry), "sha256")
    idx["tensors"][0]["sha256"] = "0" * 64
    idx_path.write_text(json.dumps(idx))
    old = trace.read(tmp_path / "t")
    first, rest = old.entries[0], [e for e in old.entries[1:] if e.digest]
    assert rest and {e.digest_alg for e in rest} == {"sha256"}
    for e in rest:
        old.tensor(e)  # verified against the sha256 recorded
    with pytest.raises(BadInput, match="content hash"):
        old.tensor(first)
    idx["tensors"][0]["digest_alg"] = "md5"
    idx_path.write_text(json.dumps(idx))
    with pytest.raises(BadInput, match="index.json.*unknown digest_alg 'md5'"):
        trace.read(tmp_path / "t")


def test_fingerprints_in_the_writer_thread_equal_those_on_the_step(tmp_path):
    plain_loop_trace(tmp_path / "step", CapturePolicy(mode="fingerprint"))
    plain_loop_trace(tmp_path / "writer", CapturePolicy(mode="fingerprint", fingerprint_async=True))
    on_step, in_writer = (
        [(e.step, e.key, e.fingerprint) for e in trace.read(tmp_path / d).entries if e.kind != "input"]
        for d in ("step", "writer"))
    assert on_step == in_writer and all(fp for _, _, fp in on_step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_fingerprint_statistics_within_the_rounding_of_their_sums(dtype):
    """Sums and norms in fp64 over values widened exactly: each within gamma_n (fp64) of the
    exact value, n the elements (blocks of them, then 16 blocks); NaN and Inf counted apart."""
    from harness.compare.bounds import gamma
    from harness.capture.fingerprint import FINGERPRINT_BLOCKS, fingerprint

    x = torch.randn(64, 100, generator=torch.Generator().manual_seed(3)).to(dtype)
    fp, xd = fingerprint(x), x.double()
    g = gamma(x.numel(), torch.float64)
    assert abs(fp["mean"] * x.numel() - float(xd.sum())) <= 2 * g * float(xd.abs().sum())  # and the division
    assert fp["l2"] == pytest.approx(float(xd.norm()), rel=g)
    assert (fp["min"], fp["max"]) == (float(xd.min()), float(xd.max()))
    assert len(fp["blocks"]) == FINGERPRINT_BLOCKS and fp["nan"] == fp["inf"] == 0
    fast, moved = fingerprint(x, "xxh3_128", "xxh3_64"), x.clone()
    moved[41, 0] += 1  # block 10 of 16 (4 rows each)
    fast_moved = fingerprint(moved, "xxh3_128", "xxh3_64")
    assert fast["xxh3_128"] != fast_moved["xxh3_128"]
    assert [i for i, (a, b) in enumerate(zip(fast["blocks"], fast_moved["blocks"])) if a != b] == [10]
    x[3, 7], x[9, 1] = float("nan"), float("inf")
    bad = fingerprint(x)
    assert (bad["nan"], bad["inf"]) == (1,
                                        1) and bad["max"] == fp["max"] and bad["xxh3_128"] != fp["xxh3_128"]
    finite = xd.isfinite()
    finite[3, 7] = finite[9, 1] = False
    assert bad["l2"] == pytest.approx(float(xd[finite].norm()), rel=g)


def test_fingerprint_of_integers_and_of_no_finite_value():
    from harness.capture.fingerprint import fingerprint

    ids = torch.arange(-5, 27, dtype=torch.int64).reshape(4, 8)
    fp = fingerprint(ids)
    assert (fp["min"], fp["max"], fp["mean"], fp["nan"]) == (-5, 26, float(ids.double().mean()), 0)
    assert fp["l2"] == pytest.approx(float(ids.double().norm()), rel=1e-15)
    inf = fingerprint(torch.tensor([float("inf"), float("nan"), float("-inf")]))
    assert (inf["nan"], inf["inf"], inf["min"], inf["l2"]) == (1, 2, None, None)


def test_comparing_two_models_is_a_bad_input(tmp_path, capsys):
    plain_loop_trace(tmp_path / "a")
    plain_loop_trace(tmp_path / "b", width=5)
    code = cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "not the same model" in err and "0.bias" in err and "[5]" in err and "[3]" in err


def test_a_modules_output_and_bias_pair_is_recorded_as_the_sum_the_layer_adds(tmp_path):
    """megatron-core's attention and MLP return (output, bias) and leave the bias to the residual
    add: recorded as output + bias, the value the golden's module returns. A layer's
    (output, context) pair, or a bias of another width, is not a bias: the output alone."""
    cap = Capture(tmp_path / "t", rank=0, world_size=1, coord={"tp": 0, "gtp": 0, "dp": 0}, mesh={},
                  policy=CapturePolicy())
    out, bias, context = torch.randn(3, 1, 4), torch.randn(4), torch.randn(3, 1, 4)
    cap.begin_step(1)
    cap.micro_batch(0, [0])
    cap.output("activation", "attn", (out, bias))
    cap.output("activation", "layer", (out, context))
    cap.output("activation", "narrow", (out, torch.randn(2)))
    cap.end_step()
    cap.close()
    Capture.finalize(tmp_path / "t", world_size=1, coords={0: {"tp": 0, "gtp": 0, "dp": 0}}, mesh={})
    samples = assemble_trace(trace.read(tmp_path / "t")).samples
    assert torch.equal(samples[(1, "activation", "attn")][0], (out + bias)[:, 0])
    for name in ("layer", "narrow"):
        assert torch.equal(samples[(1, "activation", name)][0], out[:, 0])
