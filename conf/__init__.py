"""nxdt's Hydra config tree, installed as ``nxdt.conf`` so Hydra finds it as ``pkg://nxdt.conf``."""
