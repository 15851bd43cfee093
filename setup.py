"""kvroute's build; everything but the compiled modules is in pyproject.toml.

With ``KVROUTE_NATIVE=1`` the proxy's request-path modules (``dataplane/native.py``) are
compiled with mypyc, which needs mypy (the dev extra has it) and a C compiler with
Python's headers; without it the build is pure Python.
"""

import importlib.util
import os
from pathlib import Path

from setuptools import Extension, setup


def _native() -> list[Extension]:
    if os.environ.get("KVROUTE_NATIVE") != "1":
        return []
    from mypyc.build import mypycify

    path = Path(__file__).resolve().parent / "dataplane" / "native.py"
    spec = importlib.util.spec_from_file_location("_kvroute_native", path)
    assert spec is not None and spec.loader is not None
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)
    sources = [str(native.source(name, Path())) for name in native.MODULES]
    written_in_c = [
        Extension(name, [str(native.c_source(name, Path()))], extra_compile_args=["-O3"])
        for name in native.C_MODULES
    ]
    return [*mypycify(sources, opt_level="3", group_name=native.GROUP), *written_in_c]


setup(ext_modules=_native())
