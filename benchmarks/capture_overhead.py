"""Per-step cost of capture: losses and scalars only, fingerprints, full capture.

A plain torch model of the scale check's weight sizes (hidden 512, FFN 4096, 4 blocks, vocab
4096: 25M parameters) trains with SGD; each step records the parameters and their gradients
under each capture policy in turn (interleaved, one thread for torch). Full capture and the
asynchronous fingerprint copy the tensors on the step and hash (and write) them in the writer
thread; the figure includes ``close`` (waiting for the writer) spread over the steps, and the
step alone. Process CPU time per step is printed too: on a shared machine it is the steadier
figure, and it counts the writer thread's work.

    PYTHONPATH=. python benchmarks/capture_overhead.py [--steps 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

import torch
from torch.distributed.tensor import Replicate

from harness.capture import fingerprint as fp
from harness.capture.api import Capture
from harness.common.layout import Layout
from harness.scenario.schema import CapturePolicy

POLICIES = {
    "losses+scalars": CapturePolicy(kinds=("loss", "scalar")),
    "fingerprint": CapturePolicy(kinds=("loss", "scalar", "param", "main_grad"), mode="fingerprint"),
    "fingerprint (async)": CapturePolicy(kinds=("loss", "scalar", "param", "main_grad"), mode="fingerprint",
                                         fingerprint_async=True),
    "full": CapturePolicy(kinds=("loss", "scalar", "param", "main_grad")),
}
XXH3 = {"fingerprint, xxh3 digests": "fingerprint",
        "fingerprint (async), xxh3 digests": "fingerprint (async)"}
"""Rows measured with fingerprint.WHOLE_DIGEST / BLOCK_DIGEST set to xxh3_128 / xxh3_64."""


def model() -> torch.nn.Module:
    h, ffn, vocab = 512, 4096, 4096
    blocks = [torch.nn.Sequential(torch.nn.Linear(h, 3 * h, bias=False),
                                  torch.nn.Linear(3 * h, h, bias=False),
                                  torch.nn.Linear(h, ffn, bias=False), torch.nn.GELU(),
                                  torch.nn.Linear(ffn, h, bias=False)) for _ in range(4)]
    return torch.nn.Sequential(torch.nn.Embedding(vocab, h), *blocks, torch.nn.Linear(h, vocab, bias=False))


def layout(name: str, p: torch.Tensor) -> Layout:
    return Layout(tuple(p.shape), {"tp": 1}, {"tp": Replicate()})


def run(policy: CapturePolicy, net, opt, steps: int, tokens: torch.Tensor) -> tuple[float, float, float]:
    """Seconds per step: without waiting for the writer, with close, and process CPU with close."""
    with tempfile.TemporaryDirectory() as d:
        cap = Capture(d, rank=0, world_size=1, coord={"tp": 0, "gtp": 0, "dp": 0}, mesh={"tp": 1},
                      policy=policy)
        t0, c0 = time.perf_counter(), time.process_time()
        for step in range(1, steps + 1):
            cap.begin_step(step)
            loss = torch.nn.functional.cross_entropy(net(tokens[:, :-1]).flatten(0, 1),
                                                     tokens[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            cap.params("main_grad", net.named_parameters(), layout, value=lambda p: p.grad)
            opt.step()
            cap.params("param", net.named_parameters(), layout)
            cap.scalar("loss", float(loss.detach()))
            cap.end_step()
        steps_done = time.perf_counter()
        cap.close()
        end, cpu = time.perf_counter(), time.process_time() - c0
    return (steps_done - t0) / steps, (end - t0) / steps, cpu / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    tokens = torch.randint(0, 4096, (2, 129))
    n = sum(p.numel() for p in net.parameters())
    best = {k: (float("inf"),) * 3 for k in [*POLICIES, *XXH3]}
    for _ in range(args.rounds):
        for name in best:
            fp.WHOLE_DIGEST, fp.BLOCK_DIGEST = ("xxh3_128", "xxh3_64") if name in XXH3 else ("sha256",
                "crc32")
            policy = POLICIES[XXH3.get(name, name)]
            best[name] = tuple(map(min, best[name], run(policy, net, opt, args.steps, tokens)))
    base, base_cpu = best["losses+scalars"][1], best["losses+scalars"][2]
    print(f"# {platform.machine()}, torch {torch.__version__}, 1 thread, {n / 1e6:.1f}M parameters, "
          f"params + grads each step, best of {args.rounds} interleaved rounds, load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| capture | s/step (step only) | s/step (with writes) | vs losses+scalars | CPU s/step | CPU vs "
          "losses+scalars |")
    print("|---|---|---|---|---|---|")
    for name, (step, total, cpu) in best.items():
        print(f"| {name} | {step:.3f} | {total:.3f} | {total / base:.2f}x | {cpu:.3f} | "
              f"{cpu / base_cpu:.2f}x |")


if __name__ == "__main__":
    main()
