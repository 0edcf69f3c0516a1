"""The optional C extension (nxdt/comm/_native.c: the shm transport's hot loop); everything else is in
pyproject.toml. ``optional=True``: without a C compiler or Python headers the install still succeeds and
nxdt.comm uses its torch fallback (nxdt/comm/native.py says so once, at first use)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "nxdt.comm._native",
            ["nxdt/comm/_native.c"],
            optional=True,
            extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math"],
        )
    ]
)
