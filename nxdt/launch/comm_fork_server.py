"""What the fork server of ``nxdt comm-test -N``'s node agents imports before forking the benchmark's ranks
(``nxdt.launch.multinode.launch_node``'s ``server_preload``); imported nowhere else.

A rank of the benchmark needs torch and nxdt.comm, not Lightning: this is :mod:`nxdt.launch.fork_server` without
the training imports. Each rank used to be a spawned interpreter importing torch on its own (≈ 4 CPU-s a rank, one
after another when ranks outnumber cores); now the node imports it once and forks its ranks. The server dies with its
agent, as the training one does (its ranks hold the server's "agent alive" pipe open).
"""

import nxdt.gc_paused  # noqa: F401  (first: the collector paused for the imports below, until nxdt.comm.frozen)

import atexit  # noqa: E402
import os  # noqa: E402

from nxdt.launch.forking import die_with_agent  # noqa: E402

die_with_agent()

import nxdt.launch.comm_test  # noqa: E402,F401  (the rank's entry point and what it imports: torch, nxdt.comm)

# the ranks' collections skip what they share with the server (as nxdt.launch.fork_server's), then the collector resumes
import nxdt.comm.frozen  # noqa: E402,F401

atexit.register(os._exit, 0)
