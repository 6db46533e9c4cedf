"""Only the compiled admission core; everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shm_layout._core",
            sources=["shm_layout/_core.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers",
                                # the core's float arithmetic must equal ledger.py's, bit for bit
                                "-ffp-contract=off"],
            # glibc < 2.34 keeps pthread in libpthread; harmless elsewhere
            libraries=["pthread"],
        )
    ]
)
