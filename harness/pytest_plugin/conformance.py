"""pytest plugin: the DistributedWeight conformance clauses as test items.

Enable it with ``-p harness.pytest_plugin.conformance`` (or its pytest11 entry point) and name
an implementer with ``--distributed-weight-impl module:factory`` (ini: ``distributed_weight_impl``).
Optionally restrict topologies with ``--distributed-weight-topology 1x2,2x2`` (ini:
``distributed_weight_topology``). Without an implementer the plugin does nothing.

Run pytest itself under torchrun, one process per rank::

    torchrun --nproc-per-node 4 -m pytest -p harness.pytest_plugin.conformance \\
        --distributed-weight-impl my_pkg.weights:factory -k conformance

Every rank collects the same items (one per clause, under ``conformance::``). The first item
to run drives the whole kit on all ranks together; every rank's results are gathered, so a
clause that fails on any rank fails on every rank.
"""

from __future__ import annotations

import pytest

from harness.pytest_plugin.options import resolve

IMPL_HELP = "DistributedWeight factory to check, as module:factory (run pytest under torchrun)"
TOPOLOGY_HELP = "comma-separated TxG topologies for the conformance kit (default: all that fit)"


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register the options and their ini twins (one help string each)."""
    group = parser.getgroup("distributed-weight", "DistributedWeight conformance")
    group.addoption(
        "--distributed-weight-impl",
        dest="distributed_weight_impl",
        metavar="MODULE:FACTORY",
        help=IMPL_HELP,
    )
    group.addoption(
        "--distributed-weight-topology",
        dest="distributed_weight_topology",
        metavar="TxG,...",
        help=TOPOLOGY_HELP,
    )
    parser.addini("distributed_weight_impl", IMPL_HELP, default="")
    parser.addini("distributed_weight_topology", TOPOLOGY_HELP, default="")


def pytest_configure(config: pytest.Config) -> None:
    """Register the conformance session only when an implementer is named.

    Everything heavier than option parsing (torch, the kit) is imported only then.
    """
    impl = resolve(config, "distributed_weight_impl")
    spec, source = impl.value, impl.where
    if not spec:
        return
    from harness.pytest_plugin.conformance_session import ConformanceSession
    from harness.conformance.kit import BadSpec, Topology, load_factory

    try:
        factory = load_factory(spec)
    except BadSpec as exc:
        raise pytest.UsageError(f"{source}: {exc}") from None
    topology = resolve(config, "distributed_weight_topology")
    text, topo_source = topology.value or "", topology.where
    try:
        topologies = [Topology.parse(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise pytest.UsageError(f"{topo_source}: {exc}") from None
    session = ConformanceSession(spec, factory, topologies)
    config.pluginmanager.register(session, "distributed-weight-conformance")
