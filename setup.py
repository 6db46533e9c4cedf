"""Only the compiled admission core; everything else is in pyproject.toml.

The core is built against the stable ABI (``Py_LIMITED_API`` for 3.11, heap types),
so one binary wheel per platform serves every CPython from 3.11 on (``cp311-abi3``).
"""

from setuptools import Extension, setup

LIMITED_API = 0x030B0000  # CPython 3.11: Py_buffer joined the limited API there

setup(
    ext_modules=[
        Extension(
            "shm_layout._core",
            sources=["shm_layout/_core.c"],
            define_macros=[("Py_LIMITED_API", hex(LIMITED_API))],
            py_limited_api=True,
            extra_compile_args=[
                "-O2",
                "-Wall",
                "-Wextra",
                "-Wno-unused-parameter",
                "-Wno-missing-field-initializers",
                # the core's float arithmetic must equal ledger.py's, bit for bit
                "-ffp-contract=off",
            ],
            # glibc < 2.34 keeps pthread in libpthread; harmless elsewhere
            libraries=["pthread"],
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
