"""Wall time and peak memory of ``gtp-parity compare`` on one trace pair: one process,
``--jobs N`` worker processes and ``torchrun --nproc-per-node N``, interleaved.

Peak memory is sampled every 50 ms over the whole process tree (the command, its workers or
ranks): the peak of the tree's summed RSS, and the peak of its largest process. Mapped trace
pages count in RSS while they are resident, as they do for the kernel's accounting.

    PYTHONPATH=. python benchmarks/compare_scale.py REF CAND [--golden G] [--jobs 2] [--rounds 1]
        [--before DIR]   # also time a checkout of other code (e.g. the code before streaming)
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            out.setdefault(ppid, []).append(int(entry))
    return out


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tree(root: int) -> list[int]:
    children, todo, out = _children(), [root], []
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def measure(cmd: list[str], env: dict, cwd: Path = ROOT) -> dict:
    """Run ``cmd``; its wall time, exit code, peak summed RSS of its tree and of one process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    total = single = 0
    while proc.poll() is None:
        sizes = [_rss(p) for p in _tree(proc.pid)]
        total, single = max(total, sum(sizes)), max(single, max(sizes, default=0))
        time.sleep(0.05)
    err = proc.stderr.read()
    return {"wall": time.perf_counter() - start, "rc": proc.returncode, "tree": total, "one": single,
            "err": err}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("reference")
    ap.add_argument("candidate")
    ap.add_argument("--golden")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--before", help="a checkout of other code to time in one process as well")
    args = ap.parse_args()
    traces = [args.reference, args.candidate] + ([args.golden] if args.golden else [])
    size = sum(f.stat().st_size for t in traces for f in Path(t).rglob("*.safetensors"))
    traces = [str(Path(t).resolve()) for t in traces]  # the runs start in other folders
    trace_args = traces[:2] + (["--golden", traces[2]] if args.golden else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    harness = [sys.executable, "-m", "harness", "compare", *trace_args]
    n = args.jobs
    configs = {"1 process": (harness, env, ROOT), f"--jobs {n}": ([*harness, "--jobs", str(n)], env, ROOT),
               f"torchrun {n}": ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  f"--nproc-per-node={n}", "-m", "harness", "compare", *trace_args], env,
                                      ROOT)}
    if args.before:  # run from that checkout: `-m harness` imports the working directory's package first
        before = Path(args.before).resolve()
        configs["before (1 process)"] = (harness, {**env, "PYTHONPATH": str(before)}, before)
    load = os.getloadavg()
    print(f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, one torch thread per "
          f"process,"
          f" traces {size / 2**30:.2f} GiB, load average {load[0]:.1f} at start")
    print("| compare | wall s | speedup | peak RSS, process tree | peak RSS, largest process | exit |")
    print("|---|---|---|---|---|---|")
    results: dict[str, list[dict]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i, (name, (cmd, run_env, cwd)) in enumerate(configs.items()):
                results[name].append(measure([*cmd, "--out", f"{tmp}/{r}-{i}"], run_env, cwd))
    base = min(x["wall"] for x in results["1 process"])
    for name, runs in results.items():
        best = min(runs, key=lambda x: x["wall"])
        print(f"| {name} | {best['wall']:.1f} | {base / best['wall']:.2f}x | {best['tree'] / 2**30:.2f} GiB"
              f" | {best['one'] / 2**30:.2f} GiB | {best['rc']} |", flush=True)
        if best["rc"] not in (0, 1):
            print(f"#   {name} failed: {best['err'].strip()[-400:]}")
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
