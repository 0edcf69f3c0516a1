"""What the fork server of nxdt's agents imports before forking workers (``worker.PRELOAD``); imported
nowhere else.

The server imports every module a worker needs once; each worker is then a fork of it, ready to train.

* It dies with its agent, like a worker (``die_with_agent``): the workers' parent-death signal is tied
  to the server, and the workers hold the server's own "agent alive" pipe open, so a killed agent
  would otherwise leave both running.
* When its agent ends normally, tearing down torch's and Lightning's modules would take about a second
  while the server still holds the launcher's stdout, so it exits at once instead. Its children never
  run this: forked workers end through multiprocessing's ``os._exit``, which skips atexit handlers.
"""

import atexit
import os

import nxdt.lightning.train  # noqa: F401  (the imports every worker needs)
from nxdt.launch.worker import die_with_agent

die_with_agent()
atexit.register(os._exit, 0)
