"""Only the compiled admission core; everything else is in pyproject.toml.

The core is built against the stable ABI (``Py_LIMITED_API`` for 3.11, heap types),
so one binary wheel per platform serves every CPython from 3.11 on (``cp311-abi3``).
"""

import os

from setuptools import Extension, setup

# The stable ABI switch. True: shm_layout/_core.c compiles against the limited
# API of 3.11 (Py_LIMITED_API, heap types via PyType_FromSpec): the core is built as
# _core.abi3.so and `make wheel` tags the wheel cp311-abi3, one wheel per platform for
# every CPython from 3.11 on. False: a cp311-cp311 wheel for this interpreter only.
LIMITED_API = True
LIMITED_API_VERSION = "cp311"  # the oldest CPython the abi3 wheel serves: requires-python
LIMITED_API_HEX = "0x030B0000"  # 3.11: Py_buffer joined the limited API there

# The core's test entry points (_core.c section 9: hold_lock, abandon, die_in_section) are
# compiled in only when this is set to 1, as the Makefile's test install does; a wheel or
# `pip install .` has none of them (_core.TEST_HOOKS == 0).
TEST_HOOKS = os.environ.get("GATEWAY_CAPACITY_TEST_HOOKS") == "1"
MACROS = [("Py_LIMITED_API", LIMITED_API_HEX)] if LIMITED_API else []
if TEST_HOOKS:
    MACROS.append(("GWCAP_TEST_HOOKS", "1"))

setup(
    ext_modules=[
        Extension(
            "shm_layout._core",
            sources=["shm_layout/_core.c"],
            # what _core.c includes of ours: a change to either rebuilds it, and both go
            # into the sdist
            depends=[
                "shm_layout/_layout.h",  # generated from layout.py: python -m shm_layout.gen_header
                "shm_layout/_guard.h",  # the SIGBUS guard, _core.c section 1b
            ],
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
            define_macros=MACROS,
            py_limited_api=LIMITED_API,
        )
    ],
    # bdist_wheel tags the wheel with the limited API's version and abi3
    options={"bdist_wheel": {"py_limited_api": LIMITED_API_VERSION}} if LIMITED_API else {},
)
