"""One campaign from the folders of its nodes (``gtp-parity fuzz --node I/N`` on each, then
``--merge``): the judged pairs in index order, clusters of the same fingerprint, pattern and needs
made one (the first node's shrink kept, members joined), coverage over every pair, and the
throughput of the nodes together (pairs over the longest node's judging time)."""

from __future__ import annotations

import tomllib
from collections import Counter
from pathlib import Path

import tomli_w

from harness.common.errors import BadInput
from harness.fuzz.campaign import Settings, State, _write, read_state
from harness.fuzz.cluster import Cluster
from harness.fuzz.space import Coverage, Draw


def _node_doc(folder: Path, settings: Settings) -> dict:
    path = folder / "fuzz.json"
    doc = read_state(path)
    identity = dict(doc["identity"])
    node = identity.pop("node", None)
    if identity != {k: v for k, v in settings.identity().items() if k != "node"}:
        raise BadInput(str(path), "holds a campaign of another seed, space, tree or faults than this "
                                  "command's")
    if not (isinstance(node, list) and len(node) == 2):
        raise BadInput(str(path), "is not one node's share of a campaign (run with --node I/N)")
    doc["node"] = node
    return doc


def _renamed_scenario(path: Path, settings: Settings, cluster: str, out: Path) -> str:
    """A node's minimal scenario under the merged cluster's id (nodes number clusters alike)."""
    doc = tomllib.loads(path.read_text(encoding="utf-8"))
    doc["name"] = f"fuzz-{settings.seed}-{cluster.lower()}"
    target = out / "scenarios" / f"{doc['name']}.toml"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(tomli_w.dumps(doc), encoding="utf-8")
    return str(target.relative_to(out))


def merge(folders: list[Path], settings: Settings, out: Path) -> dict:
    """Fold the nodes' campaign folders into ``out`` (fuzz.json, index.html, stages.toml and the
    clusters' minimal scenarios); return the merged document."""
    if any(f.resolve() == out.resolve() for f in folders):
        raise BadInput("--out", f"{out} is one of the nodes' folders: merge into another")
    docs = [_node_doc(f, settings) for f in folders]
    nodes = {d["node"][1] for d in docs}
    given = sorted(d["node"][0] for d in docs)
    if len(nodes) != 1 or given != list(range(next(iter(nodes)))):
        raise BadInput("--merge", f"needs every node of one campaign once: got nodes {given} of "
                                  f"{sorted(nodes)}")
    state = State(identity={**settings.identity(), "nodes": next(iter(nodes))})
    state.judged = sorted((j for d in docs for j in d["judged"]), key=lambda j: j["index"])
    state.refused = sum((Counter(d["refused"]) for d in docs), Counter())
    state.elapsed_s = max(d["elapsed_s"] for d in docs)
    state.pair_s = max(d["pair_s"] for d in docs)  # the nodes judge at once
    renamed: dict[tuple[int, str], str] = {}
    index_of = {j["name"]: j["index"] for j in state.judged}
    found = [(node, folder, Cluster.from_json(c)) for node, (folder, d) in enumerate(zip(folders, docs))
             for c in d["clusters"]]
    # numbered by their first pair, as one node judging every pair in order would number them
    for node, folder, c in sorted(found, key=lambda f: min(index_of.get(m, 0) for m in f[2].members or [""])):
        home = next((h for h in state.clusters
                     if (h.fingerprint, h.pattern, h.needs) == (c.fingerprint, c.pattern, c.needs)), None)
        members, old = list(c.members), c.id
        if home is None:
            home = c
            home.id, home.members = f"C{len(state.clusters) + 1}", []
            if c.scenario_file:
                home.scenario_file = _renamed_scenario(folder / c.scenario_file, settings, home.id, out)
            state.clusters.append(home)
        home.members += members
        renamed[(node, old)] = home.id
    for node, d in enumerate(docs):
        for j in d["judged"]:
            if j.get("cluster") is not None:
                j["cluster"] = renamed[(node, j["cluster"])]
    coverage = Coverage()
    for j in state.judged:
        coverage.add(Draw.from_json(j["draw"]))
    out.mkdir(parents=True, exist_ok=True)
    return _write(state, settings, coverage, out)
