"""The model hub, installed as ``nxdt.models`` (one module + one config per model)."""
