"""Sides beyond one machine: a launch spread over nodes, and the rank a worker is.

A launch of world W can run as N nodes of W/N ranks each: every node runs torchrun with
``--nnodes N --node-rank R`` and one c10d rendezvous endpoint (node rank 0 hosts its store), or
the cluster's launcher (SLURM's ``srun``) starts the W workers itself. Either way each rank
writes its part of the trace into the side's trace folder, which every node must see at the
same path. What names a trace (its side key) does not depend on how it was launched.

:func:`rank_env` reads who a worker is from torchrun's variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``GROUP_RANK``) or SLURM's (``SLURM_PROCID``, ``SLURM_NTASKS``,
``SLURM_LOCALID``, ``SLURM_NODEID``, with ``MASTER_ADDR``/``MASTER_PORT``), torchrun's first.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.common.errors import BadInput

NODE_ENV = "PARITY_NODE_RANK"
"""The node rank a supervised launch (``gtp-parity launch``) hands its ranks: torchrun's c10d
rendezvous numbers nodes in its own order (``GROUP_RANK``), the user's ``--node-rank`` is what
a failure names."""

_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


def parse_endpoint(text: str, flag: str = "--rdzv-endpoint") -> tuple[str, int]:
    """``HOST:PORT`` (``[IPv6]:PORT`` too) -> (host, port); BadInput naming ``flag`` otherwise."""
    m = re.fullmatch(r"\[(?P<v6>[0-9A-Fa-f:.]+)\]:(?P<port>\d{1,5})|(?P<host>[^:\[\]]+):(?P<p>\d{1,5})", text)
    if not m:
        raise BadInput(flag, f"{text!r} is not HOST:PORT (e.g. 10.0.0.1:29500, or [::1]:29500)")
    host, port = (m["v6"], int(m["port"])) if m["v6"] else (m["host"], int(m["p"]))
    if m["v6"]:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise BadInput(flag, f"{text!r}: {host!r} is not an IPv6 address") from None
    elif not _HOST.match(host):
        raise BadInput(flag, f"{text!r}: {host!r} is not a host name or address")
    if not 1 <= port <= 65535:
        raise BadInput(flag, f"{text!r}: port must be 1..65535, got {port}")
    return host, port


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def rdzv_id(name: str) -> str:
    """The rendezvous id of a launch: every node of it joins this one."""
    return f"gtp-parity-{name}"


@dataclass(frozen=True)
class Nodes:
    """How one launch is spread: ``nnodes`` nodes, this one ``node_rank``, their rendezvous."""

    nnodes: int
    node_rank: int
    endpoint: str

    @classmethod
    def of(cls, nnodes: int, node_rank: int, endpoint: str | None, world: int) -> Nodes:
        """Check the flags against each other and the launch's world size (BadInput naming the flag)."""
        if nnodes < 1:
            raise BadInput("--nnodes", f"must be >= 1, got {nnodes}")
        if not 0 <= node_rank < nnodes:
            raise BadInput("--node-rank", f"must be in 0..{nnodes - 1} (--nnodes {nnodes}), got {node_rank}")
        if nnodes > 1 and not endpoint:
            raise BadInput("--rdzv-endpoint", f"needed with --nnodes {nnodes}: HOST:PORT of node rank 0")
        if endpoint:
            parse_endpoint(endpoint)
        if world % nnodes:
            raise BadInput("--nnodes", f"the launch has {world} rank(s), not a multiple of {nnodes} node(s)")
        return cls(nnodes, node_rank, endpoint or "")

    def per_node(self, world: int) -> int:
        return world // self.nnodes

    def torchrun(self, plan_path: Path, world: int, name: str, join_timeout_s: float,
                 python: str = sys.executable) -> list[str]:
        """This node's torchrun command line: c10d rendezvous, node rank 0 hosting the store.
        (With a loopback endpoint every node is on this machine and would take itself for the
        host: there the first node to bind the port hosts it, the others join it.)"""
        host, _ = parse_endpoint(self.endpoint)
        local = is_loopback(host)
        host_conf = "" if local and self.node_rank == 0 else f"is_host={int(self.node_rank == 0)},"
        conf = f"{host_conf}join_timeout={int(join_timeout_s)}"
        local = [f"--local-addr={host}"] if local else []
        return [
            python, "-m", "torch.distributed.run", f"--nnodes={self.nnodes}", f"--node-rank={self.node_rank}",
            f"--nproc-per-node={self.per_node(world)}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={rdzv_id(name)}", f"--rdzv-conf={conf}", *local, "--max-restarts=0",
            "-m", "harness.backends.worker", str(plan_path),
        ]


@dataclass(frozen=True)
class RankEnv:
    """Who this worker is, and which launcher said so."""

    rank: int
    world: int
    local_rank: int
    node: int
    launcher: str  # "torchrun", "slurm" or "single"


def _int(env: dict, name: str) -> int:
    try:
        value = int(env[name])
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"{name}={value} is negative")
    return value


def rank_env(env: dict, plan_world: int) -> RankEnv:
    """Rank, world size, local rank and node of this worker, from torchrun's variables, else
    SLURM's (``srun`` starting the workers itself), else a single rank. Under SLURM the process
    group's store is at ``MASTER_ADDR:MASTER_PORT``, which must be set; a plan of world 1 runs
    as task 0 alone (a batch script's own step sees the allocation's SLURM_NTASKS)."""
    if "RANK" in env or "WORLD_SIZE" in env:
        node = _int(env, NODE_ENV) if NODE_ENV in env else _int(env,
                                                                "GROUP_RANK") if "GROUP_RANK" in env else 0
        return RankEnv(_int(env, "RANK") if "RANK" in env else 0,
                       _int(env, "WORLD_SIZE") if "WORLD_SIZE" in env else 1,
                       _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0, node, "torchrun")
    if "SLURM_PROCID" in env:
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS") if "SLURM_NTASKS" in env else 1
        if not rank < world:
            raise ValueError(f"SLURM_PROCID={rank} is not below SLURM_NTASKS={world}")
        if plan_world == 1:
            if rank:
                raise ValueError(f"a plan of world size 1 runs as one task, not as SLURM_PROCID={rank} "
                                 f"of {world}: srun --ntasks 1 (or no srun)")
            world = 1
        if world > 1:
            missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
            if missing:
                raise ValueError(f"under SLURM ({world} tasks) set {' and '.join(missing)}: where rank 0 "
                                 "hosts the process group's store (e.g. the first node of the allocation)")
        local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        return RankEnv(rank, world, local, node, "slurm")
    return RankEnv(0, 1, 0, 0, "single")


def read_plan(path: str) -> dict:
    """A launch plan written by ``gtp-parity plan`` (or a launch); BadInput naming it otherwise."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise BadInput(path, f"not a readable launch plan ({type(e).__name__}: {e})") from None
    ok = isinstance(doc, dict) and isinstance(doc.get("jobs"), list) and doc["jobs"]
    if not ok or not isinstance(doc.get("world"), int) or not isinstance(doc.get("name"), str):
        raise BadInput(path, "not a launch plan (written by `gtp-parity plan`: name, world, jobs)")
    return doc


def node_commands(name: str, plan_path: Path, world: int, nnodes: int, endpoint: str | None, root: Path,
                  python: str = sys.executable) -> tuple[str, list[tuple[str, str]]]:
    """What runs one launch (``gtp-parity plan`` prints it): where, and (how, command line)
    pairs, any one of which does. A launch whose world does not split over ``nnodes`` runs on
    one node."""
    py, plan = shlex.quote(python), shlex.quote(str(plan_path))
    env = f"PYTHONPATH={shlex.quote(str(root))} OMP_NUM_THREADS=1"
    worker = f"{env} {py} -m harness.backends.worker {plan}"
    if nnodes > 1 and world % nnodes == 0:
        ep, per = endpoint or "HOST:PORT", world // nnodes
        where = (f"on {nnodes} nodes, {per} rank(s) each: node rank R = 0..{nnodes - 1} on each, "
                 f"node 0 at {ep} hosting the rendezvous; every node sees this run folder at the same path")
        return where, [
            ("supervised (timeouts, failures named by node and rank)",
             f"{env} {py} -m harness launch {plan} --nnodes {nnodes} --node-rank R --rdzv-endpoint {ep}"),
            ("your torchrun", f"{env} {py} -m torch.distributed.run --nnodes={nnodes} --node-rank=R "
                              f"--nproc-per-node={per} --rdzv-backend=c10d --rdzv-endpoint={ep} "
                              f"--rdzv-id={rdzv_id(name)} "
                              "--max-restarts=0 "
                              f"-m harness.backends.worker {plan}"),
            ("SLURM, MASTER_ADDR and MASTER_PORT exported",
             f"srun --nodes={nnodes} --ntasks={world} --ntasks-per-node={per} env {worker}"),
        ]
    split = f" (world {world} does not split over {nnodes} nodes)" if nnodes > 1 and world > 1 else ""
    lines = [("supervised (timeouts, failures named by rank)", f"{env} {py} -m harness launch {plan}")]
    if world > 1:
        lines.append(("SLURM, MASTER_ADDR and MASTER_PORT exported",
                      f"srun --nodes=1 --ntasks={world} env {worker}"))
    else:
        lines.append(("plain", worker))
    return f"on one node{split}", lines
