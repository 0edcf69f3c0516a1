"""What the fork server of nxdt's agents imports before forking workers (``forking.PRELOAD``); imported
nowhere else.

The server imports every module a worker needs once; each worker is then a fork of it, ready to train.

* It dies with its agent, like a worker (``die_with_agent``): the workers' parent-death signal is tied
  to the server, and the workers hold the server's own "agent alive" pipe open, so a killed agent
  would otherwise leave both running. It says so before its imports: ``nxdt train`` starts it while it
  still checks the config, data and model, and a launcher that stops at a failed check takes it along.
* When its agent ends normally, tearing down torch's and Lightning's modules would take about a second
  while the server still holds the launcher's stdout, so it exits at once instead. Its children never
  run this: forked workers end through multiprocessing's ``os._exit``, which skips atexit handlers.
"""

import nxdt.gc_paused  # noqa: F401  (first: the collector paused for the imports below, until nxdt.comm.frozen)

import atexit  # noqa: E402
import os  # noqa: E402

from nxdt.launch.forking import die_with_agent  # noqa: E402

die_with_agent()

import nxdt.lightning.train  # noqa: E402,F401  (the imports every worker needs)
from nxdt.config import schema_tree  # noqa: E402

schema_tree()  # the typed config tree every worker reads its run's config.yaml onto, built once (~0.08 CPU-s a worker)

# What the server holds now goes to the collector's permanent generation: a worker's collections then never walk (and so
# never write to, copying each page they touch) the objects it shares with the server. A warm launch of one step on
# 2 ranks, forked as these workers are: 3.0 -> 1.6 CPU-s (docs/architecture.md §9, "Budget"). Then the collector resumes.
import nxdt.comm.frozen  # noqa: E402,F401

atexit.register(os._exit, 0)
