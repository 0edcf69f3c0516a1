"""nxdt: an open distributed-training launcher (see DESIGN.md / README.md)."""

__version__ = "0.1.0"
