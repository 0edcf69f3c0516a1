"""nxdt: an open distributed-training launcher (see README.md and docs/architecture.md)."""

__version__ = "0.1.0"
