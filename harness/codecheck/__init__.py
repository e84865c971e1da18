"""Checks across megatron-core trees, built on the session: ``gtp-parity canary`` (does the
CPU layer hold on a tree?), ``gtp-parity gate`` (does a change of tree change what GTP
trains? a PR's CI) and ``gtp-parity bisect`` (the first commit whose verdict differs)."""
