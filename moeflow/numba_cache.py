"""numba's on-disk cache for compiled functions that inline functions of other files.

numba stamps a cached function with its own file only (its modification time and size), so a cached function
that calls a function of another module would survive an edit of that module and run stale code.
`stamped_locators(owns, stamp)` adds numba cache locators (user-provided dir, in-tree, user-wide) whose source
stamp is `stamp()`, a digest of every file the owned functions depend on, for the functions whose file satisfies
`owns`; `file_digest` computes such a digest; `njit_cached` compiles a function with or without that cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def file_digest(paths: Iterable[Path]) -> str:
    """sha256 over each file's name and bytes, in the given order."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def stamped_locators(owns: Callable[[Path], bool], stamp: Callable[[], str]) -> list[type]:
    """Install numba cache locators stamped with `stamp()` for the functions defined in a file `owns` accepts
    (its resolved path); [] when numba's caching internals differ from the ones this was written for (then the
    caller must not cache: a stale function could survive an edit)."""
    try:
        from numba.core import caching as nc

        bases = [nc.UserProvidedCacheLocator, nc.InTreeCacheLocator, nc.UserWideCacheLocator]
        impl = getattr(nc, "CacheImpl", None) or getattr(nc, "_CacheImpl")  # noqa: B009  (older numba: _CacheImpl)
        assert isinstance(impl._locator_classes, list)
    except (ImportError, AttributeError, AssertionError):  # pragma: no cover - another numba
        return []
    out: list[type] = []
    for base in bases:

        class _Stamped(base):  # type: ignore[valid-type, misc]
            def get_source_stamp(self):
                return stamp()

            @classmethod
            def from_function(cls, py_func, py_file):
                if not owns(Path(py_file).resolve()):
                    return None
                return super().from_function(py_func, py_file)

        out.append(_Stamped)
    impl._locator_classes[:0] = out
    return out


def njit_cached(fn: Callable, cache: bool, **opts: Any) -> Callable:
    """`numba.njit(**opts)(fn)`, cached on disk when `cache` and a cache location is writable (else compiled once
    per process); `fn` itself, run as Python, without numba."""
    try:
        from numba import njit
    except ImportError:  # pragma: no cover - numba is a dependency; without it the function runs as Python (slow)
        return fn
    if cache:
        try:
            return njit(cache=True, **opts)(fn)
        except RuntimeError:  # no writable cache location: compile in every process instead
            pass
    return njit(**opts)(fn)
