"""Under torchrun: every rank agrees on every test outcome (registered only there)."""

from __future__ import annotations

import json
import zlib
from datetime import timedelta

import pytest


class RankAgreement:
    """Registered only under torchrun: the ranks agree on each test phase's outcome.

    After every setup, call and teardown the ranks all-reduce their outcome over gloo. If they
    differ, each rank that did not fail reports the phase failed, naming the ranks that did, so
    all ranks go on to the same next phase. A rank that hangs or dies fails the waiting ranks'
    test after the timeout, and the ranks then stop waiting for each other.
    """

    def __init__(self, rank: int, world: int, timeout_s: float, owned: bool, group=None):
        self.rank, self.world, self.timeout_s, self.owned, self.group = rank, world, timeout_s, owned, group
        self.broken: str | None = None

    @staticmethod
    def start(rank: int, world: int, timeout_s: float) -> RankAgreement:
        import torch.distributed as dist

        owned = not dist.is_initialized()
        if owned:
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))  # whatever the default
        return RankAgreement(dist.get_rank(), dist.get_world_size(), timeout_s, owned, group)

    def _gather(self, mine: int) -> list[int]:
        """Every rank's value (each rank fills its own slot of a summed vector)."""
        import torch
        import torch.distributed as dist

        t = torch.zeros(self.world, dtype=torch.int64)
        t[self.rank] = mine
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_modifyitems(self, items):
        result = yield
        if len(set(self._gather(zlib.crc32("\n".join(i.nodeid for i in items).encode())))) != 1:
            raise pytest.UsageError(f"the ranks collected different tests (rank {self.rank}: {len(items)} "
                                    "items); run the same pytest command on every rank")
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        if self.broken is None:
            self.agree(report)
        return report

    def agree(self, report) -> None:
        code = 2 if report.failed else 1 if report.skipped else 0
        try:
            codes = self._gather(code)
        except Exception as e:  # a rank hung past the timeout or died
            self.broken = f"{type(e).__name__}: {e}"
            report.outcome = "failed"
            report.longrepr = (f"rank {self.rank}: the other ranks did not report the {report.when} outcome "
                               f"within {self.timeout_s:g} s (a rank hung, crashed or ran other tests): "
                               f"{self.broken}")
            return
        if len(set(codes)) == 1:
            return
        failed = [r for r, c in enumerate(codes) if c == 2]
        skipped = [r for r, c in enumerate(codes) if c == 1]
        if report.failed:
            report.sections.append(("gtp-parity ranks", f"failed on ranks {failed} of {self.world}"))
            return
        if hasattr(report, "wasxfail"):
            del report.wasxfail
        report.outcome = "failed"
        here = "was skipped" if code == 1 else "passed"
        report.longrepr = (f"{report.when} failed on rank(s) {failed} of {self.world} (this is rank "
                           f"{self.rank}, where it {here}); see the failing rank's output" if failed else
                           f"{report.when} skipped on rank(s) {skipped} only (this is rank {self.rank}): "
                           "the ranks must take the same path")

    def from_rank0(self, produce, budget_s: float) -> dict:
        """Rank 0 calls ``produce``; every rank returns its result (JSON over gloo, no pickle)."""
        import torch
        import torch.distributed as dist

        if self.broken is not None:
            raise RuntimeError(f"the ranks lost contact earlier ({self.broken}); not running here")
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=budget_s))
        failure = None
        try:
            data = b""
            if self.rank == 0:
                try:
                    doc = {"ok": produce()}
                except Exception as e:
                    failure, doc = e, {"error": f"{type(e).__name__}: {e}"}
                data = json.dumps(doc).encode()
            size = torch.tensor([len(data)], dtype=torch.int64)
            dist.broadcast(size, src=0, group=group)
            buf = torch.frombuffer(bytearray(data or b" " * int(size)), dtype=torch.uint8)
            dist.broadcast(buf, src=0, group=group)
            doc = json.loads(bytes(buf.tolist()).decode())
        finally:
            dist.destroy_process_group(group)
        if failure is not None:
            raise failure
        if "error" in doc:
            raise RuntimeError(f"rank 0 failed to run the scenario: {doc['error']}")
        return doc["ok"]

    def pytest_unconfigure(self, config):
        """Leave together: torchrun stops every rank as soon as one exits with an error."""
        import torch.distributed as dist

        if self.broken is None:
            dist.barrier(group=self.group)
        if self.owned and dist.is_initialized():
            dist.destroy_process_group()
