"""next-use's two float routines shared by the Python class (`moeflow.policies.next_use`) and its compiled twin
(`moeflow.runtime.cachecore_nu`), so both add the same floats in the same order: numpy's pairwise row sum and the
f bucket of the recency table. numba functions only other numba functions call (no disk cache of their own: the
cache core's kernels inline them, and its stamp covers this file)."""

from __future__ import annotations

import math

BUCKETS = 8  # f buckets of the recency table: f in [0, 1] in equal bins on a sqrt scale

try:
    from numba import njit

    def _sub(fn):
        return njit(nogil=True, error_model="numpy", _nrt=False, no_cpython_wrapper=True, no_cfunc_wrapper=True)(fn)

except ImportError:  # pragma: no cover - numba is a dependency; without it these run as Python

    def _sub(fn):
        return fn


# ---- numpy's pairwise sum (`np.add.reduce` of float64: blocks of <= 128 with 8 accumulators, halves above) ----
@_sub
def _pw_block(F, o, n):
    if n < 8:
        res = 0.0
        for i in range(n):
            res += F[o + i]
        return res
    r0, r1, r2, r3 = F[o], F[o + 1], F[o + 2], F[o + 3]
    r4, r5, r6, r7 = F[o + 4], F[o + 5], F[o + 6], F[o + 7]
    i = 8
    m = n - n % 8
    while i < m:
        r0 += F[o + i]
        r1 += F[o + i + 1]
        r2 += F[o + i + 2]
        r3 += F[o + i + 3]
        r4 += F[o + i + 4]
        r5 += F[o + i + 5]
        r6 += F[o + i + 6]
        r7 += F[o + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += F[o + i]
        i += 1
    return res


@_sub
def _pw1(F, o, n):  # n <= 256 or so: one split
    if n <= 128:
        return _pw_block(F, o, n)
    n2 = n // 2
    n2 -= n2 % 8
    return _pw_block(F, o, n2) + _pw_block(F, o + n2, n - n2)


@_sub
def _pw2(F, o, n):
    if n <= 128:
        return _pw_block(F, o, n)
    n2 = n // 2
    n2 -= n2 % 8
    return _pw1(F, o, n2) + _pw1(F, o + n2, n - n2)


@_sub
def row_sum(F, o, n):
    """numpy's `F[o:o+n].sum()` (float64, the same additions in the same order) for n up to about 1000."""
    if n <= 128:
        return _pw_block(F, o, n)
    n2 = n // 2
    n2 -= n2 % 8
    return _pw2(F, o, n2) + _pw2(F, o + n2, n - n2)


@_sub
def bucket(f):
    """`NextUse._bucket`: f's bin on a sqrt scale."""
    c = 0.0 if f < 0.0 else (1.0 if f > 1.0 else f)
    b = int(math.sqrt(c) * BUCKETS)
    return BUCKETS - 1 if b > BUCKETS - 1 else b
