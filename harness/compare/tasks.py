"""The work of a compare as tasks over (step, kind, name) keys; their results as plain data.

A ``pair`` task assembles one key of the reference and the candidate (and the golden),
measures and judges it, and drops the tensors: peak memory follows the largest logical
tensor, not the traces' size. A ``check`` task assembles a key that no pair reads (a tensor
only one trace holds) alone and drops it, so every key of every trace is read once and
checked as :func:`harness.compare.assemble.assemble_trace` checks it: its content hash, its shards,
its replica and padding invariants.

Tasks are listed in the order rows have always come in (the reference's keys in trace order,
then its sample keys), so a compare split over processes or ranks orders and localizes its
rows exactly as one process does. A part's results are JSON: rows (numbers, strings, lists),
the main_grads' squared differences the grad-norm consistency sums, and the candidate's
invariant violations. Nothing but our own JSON crosses a process boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from harness.compare.assemble import LazyLogical



@dataclass(frozen=True)
class Task:
    action: str  # "pair" or "check"
    key: tuple[int, str, str]
    role: str = "reference"  # check: the trace whose key it is
    golden_key: tuple[int, str, str] | None = None  # pair: the golden's tensor for this key


def collect(logical: dict[str, LazyLogical]) -> list[Task]:
    """Every task of a compare, in row order, then the checks."""
    ref, cand, golden = logical["reference"], logical["candidate"], logical.get("golden")
    tasks, read = [], {role: set() for role in logical}
    for key in ref.placed_keys:
        # grad_terms: a bound's input, read by its main_grad's pair (harness.compare.judge)
        if key in cand.tensors and key[1] != "grad_terms":
            g = None
            if golden is not None:
                if key in golden.tensors:
                    g = key
                elif key[1] == "master" and (key[0], "param", key[2]) in golden.tensors:
                    g = (key[0], "param", key[2])  # the golden's weights are its masters
            tasks.append(Task("pair", key, golden_key=g))
            read["reference"].add(key), read["candidate"].add(key)
            if g is not None:
                read["golden"].add(g)
    for key in ref.sample_keys:
        if key in cand.samples:
            tasks.append(Task("pair", key))
            read["reference"].add(key), read["candidate"].add(key)
            if golden is not None and key in golden.samples:
                read["golden"].add(key)
    for role, side in logical.items():
        tasks += [Task("check", key, role) for key in side.placed_keys + side.sample_keys
                  if key not in read[role]]
    return tasks


def cost(task: Task, logical: dict[str, LazyLogical]) -> int:
    """Elements a task reads: what a partition balances."""
    if task.action == "check":
        return logical[task.role].numel(task.key)
    g = logical["golden"].numel(task.golden_key) if task.golden_key else 0
    return logical["reference"].numel(task.key) + logical["candidate"].numel(task.key) + g


@dataclass
class Part:
    """What one process measured: rows by task index, and what the whole compare needs."""

    rows: list[tuple[int, dict]] = field(default_factory=list)
    sq_diff: dict[tuple, float] = field(default_factory=dict)
    violations: dict[tuple, tuple[list, list]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"rows": [[i, r] for i, r in self.rows],
                "sq_diff": [[*k, v] for k, v in self.sq_diff.items()],
                "violations": [[*k, rep, pad] for k, (rep, pad) in self.violations.items()]}

    @staticmethod
    def from_json(doc: dict) -> "Part":
        return Part(rows=[(int(i), r) for i, r in doc["rows"]],
                    sq_diff={(s, k, n): v for s, k, n, v in doc["sq_diff"]},
                    violations={(s, k, n): (rep, pad) for s, k, n, rep, pad in doc["violations"]})


PairRow = Callable[[Task, dict], "tuple[dict | None, float | None]"]


def run(indexed: list[tuple[int, Task]], logical: dict[str, LazyLogical], pair_row: PairRow) -> Part:
    """Do the tasks ``indexed`` (index in the plan, task); ``pair_row`` measures one pair."""
    part = Part()
    for i, task in indexed:
        if task.action == "check":
            side = logical[task.role]
            _ = side.tensors[task.key] if task.key in side.tensors else side.samples[task.key]
            continue
        row, sq_diff = pair_row(task, logical)
        if row is not None:
            part.rows.append((i, row))
        if sq_diff is not None:
            part.sq_diff[task.key] = sq_diff
    cand = logical["candidate"]
    part.violations = {k: cand.violations_of(k) for k in cand.placed_keys if cand.checked(k)}
    return part


def merge(parts: list[Part], cand: LazyLogical) -> tuple[list[dict], dict[tuple, float]]:
    """Rows in plan order and the squared differences of every part; the candidate's
    invariant violations are recorded in ``cand`` as if it had assembled every key itself."""
    rows, sq_diff = [], {}
    for part in parts:
        rows += part.rows
        sq_diff.update(part.sq_diff)
        for key, (replica, padding) in part.violations.items():
            cand.record(key, replica, padding)
    return [r for _, r in sorted(rows, key=lambda ir: ir[0])], sq_diff


def partition(tasks: list[Task], logical: dict[str, LazyLogical], parts: int) -> list[list[tuple[int, Task]]]:
    """Split the tasks over ``parts`` processes, balanced by elements read: largest first to
    the least loaded (ties: the lowest part). Every process computes the same split from the
    same indexes, so ranks agree on it without talking."""
    loads = [0] * parts
    out: list[list[tuple[int, Task]]] = [[] for _ in range(parts)]
    by_cost = sorted(range(len(tasks)), key=lambda i: (-cost(tasks[i], logical), i))
    for i in by_cost:
        p = min(range(parts), key=lambda q: (loads[q], q))
        loads[p] += cost(tasks[i], logical)
        out[p].append((i, tasks[i]))
    return [sorted(p, key=lambda it: it[0]) for p in out]
