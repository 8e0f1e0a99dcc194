"""The compiled cache core's small structures over the flat state array `I` (`I[section offset + i]`): the
call's record log, doubly linked key lists (lru order, least-stale's queues) and the indexed heap of victim
candidates (lfu, belady)."""

from __future__ import annotations

from .cachecore_layout import (
    H_KIND,
    H_LOGON,
    H_PERLAYER,
    KIND_LFU,
    KIND_MIN,
    NPK,
    O_HEAP,
    O_HPOS,
    O_HSKIP,
    O_KR,
    O_LOG,
    O_LST,
    O_PG,
    O_PIN,
    O_PK,
    O_PROT,
    O_SC,
    O_SOF,
    PG_HSIZE,
    PK_HA,
    PK_HB,
    PK_NEXT,
    PK_PREV,
    PK_TR,
    SC_NLOG,
    _fn,
)


@_fn
def _log(I, op, s, k, arg):
    if I[H_LOGON]:
        sc = I[O_SC]
        n = I[sc + SC_NLOG]
        b = I[O_LOG] + 4 * n
        I[b], I[b + 1], I[b + 2], I[b + 3] = op, s, k, arg
        I[sc + SC_NLOG] = n + 1


@_fn
def _ll_unlink(I, li, k):
    lst = I[O_LST] + 2 * li
    prev, nxt = I[I[O_PK] + k * NPK + PK_PREV], I[I[O_PK] + k * NPK + PK_NEXT]
    if prev >= 0:
        I[I[O_PK] + prev * NPK + PK_NEXT] = nxt
    else:
        I[lst] = nxt
    if nxt >= 0:
        I[I[O_PK] + nxt * NPK + PK_PREV] = prev
    else:
        I[lst + 1] = prev
    I[I[O_PK] + k * NPK + PK_PREV] = -1
    I[I[O_PK] + k * NPK + PK_NEXT] = -1


@_fn
def _ll_append(I, li, k):
    lst = I[O_LST] + 2 * li
    tail = I[lst + 1]
    I[I[O_PK] + k * NPK + PK_PREV] = tail
    I[I[O_PK] + k * NPK + PK_NEXT] = -1
    if tail >= 0:
        I[I[O_PK] + tail * NPK + PK_NEXT] = k
    else:
        I[lst] = k
    I[lst + 1] = k


# The heap (lfu, belady): an indexed min-heap of the victim candidates, one entry (a, b, key) each at I[O_HEAP],
# ordered by (a, b), unique among keys (lfu: (count, tick), ticks are unique; belady: (-score, 0), a score
# names its key); O_HPOS holds each key's position, so an update sifts it in place. Every tracked key keeps
# its entry in PK_HA, PK_HB; only keys that are resident, unpinned and not issued by the running prefetch
# call are in the heap (`_hx_hold` takes a key out, `_hx_insert` puts it back), so the top is the victim
# (with per-layer partitions, the first entry of the part: `_hx_first`).


@_fn
def _hx_less(I, x, y):
    return I[x] < I[y] or (I[x] == I[y] and I[x + 1] < I[y + 1])


@_fn
def _hx_sift(I, i):
    """Restore the heap order around position i: its entry moves up, else down, parents or children moving
    into the hole it leaves."""
    h, n, hp = I[O_HEAP], I[I[O_PG] + PG_HSIZE], I[O_HPOS]
    a, b, k = I[h + 3 * i], I[h + 3 * i + 1], I[h + 3 * i + 2]
    j = i
    while j > 0:
        q = (j - 1) // 2
        y = h + 3 * q
        if not (a < I[y] or (a == I[y] and b < I[y + 1])):
            break
        x = h + 3 * j
        I[x], I[x + 1], I[x + 2] = I[y], I[y + 1], I[y + 2]
        I[hp + I[x + 2]] = j
        j = q
    if j == i:
        while True:
            c = 2 * j + 1
            if c >= n:
                break
            if c + 1 < n and _hx_less(I, h + 3 * c + 3, h + 3 * c):
                c += 1
            y = h + 3 * c
            if not (I[y] < a or (I[y] == a and I[y + 1] < b)):
                break
            x = h + 3 * j
            I[x], I[x + 1], I[x + 2] = I[y], I[y + 1], I[y + 2]
            I[hp + I[x + 2]] = j
            j = c
    x = h + 3 * j
    I[x], I[x + 1], I[x + 2] = a, b, k
    I[hp + k] = j


@_fn
def _hx_put(I, k, a, b):
    """Key k (not in the heap) enters with entry (a, b)."""
    h, pg = I[O_HEAP], I[O_PG]
    i = I[pg + PG_HSIZE]
    I[pg + PG_HSIZE] = i + 1
    I[I[O_HPOS] + k] = i
    x = h + 3 * i
    I[x], I[x + 1], I[x + 2] = a, b, k
    _hx_sift(I, i)


@_fn
def _hx_set(I, k, a, b):
    """Key k's entry is now (a, b): sifted in place if it is in the heap, entered if it is a candidate."""
    pk = I[O_PK] + k * NPK
    I[pk + PK_HA] = a
    I[pk + PK_HB] = b
    i = I[I[O_HPOS] + k]
    if i >= 0:
        x = I[O_HEAP] + 3 * i
        I[x] = a
        I[x + 1] = b
        _hx_sift(I, i)
        return
    s = I[I[O_SOF] + k]
    if s >= 0 and I[I[O_PIN] + s] == 0 and I[I[O_PROT] + s] == 0:
        _hx_put(I, k, a, b)


@_fn
def _hx_remove(I, k):
    h, pg, at = I[O_HEAP], I[O_PG], I[O_HPOS] + k
    i = I[at]
    if i < 0:
        return
    n = I[pg + PG_HSIZE] - 1
    I[at] = -1
    I[pg + PG_HSIZE] = n
    if i != n:
        for t in range(3):
            I[h + 3 * i + t] = I[h + 3 * n + t]
        I[I[O_HPOS] + I[h + 3 * i + 2]] = i
        _hx_sift(I, i)


@_fn
def _hx_hold(I, k):
    """Key k is pinned or issued: out of the heap until `_hx_insert`."""
    kind = I[H_KIND]
    if kind == KIND_LFU or kind == KIND_MIN:
        _hx_remove(I, k)


@_fn
def _hx_insert(I, k):
    """Resident key k is a candidate again: back into the heap with its entry (a tracked key only: a demand
    load's entry is set by the access that follows)."""
    kind = I[H_KIND]
    if (kind == KIND_LFU or kind == KIND_MIN) and I[I[O_HPOS] + k] < 0 and I[I[O_PK] + k * NPK + PK_TR]:
        pk = I[O_PK] + k * NPK
        _hx_put(I, k, I[pk + PK_HA], I[pk + PK_HB])


@_fn
def _is_cand(I, k, part):
    """A victim candidate of `part`: resident, not pinned, not issued by the running prefetch call."""
    s = I[I[O_SOF] + k]
    if s < 0 or I[I[O_PIN] + s] or I[I[O_PROT] + s]:
        return False
    return not I[H_PERLAYER] or I[I[O_KR] + k] == part


@_fn
def _hx_first(I, part):
    """The smallest entry whose key is a candidate (-1: none): best-first over the heap, a frontier of
    positions (a small heap at I[O_HSKIP]) holding the children of the non-candidates passed."""
    h, f, n = I[O_HEAP], I[O_HSKIP], I[I[O_PG] + PG_HSIZE]
    if n == 0:
        return -1
    m = 1
    I[f] = 0
    while m > 0:
        i = I[f]  # the frontier's smallest position; pop it
        m -= 1
        I[f] = I[f + m]
        j = 0
        while True:
            c = 2 * j + 1
            if c >= m:
                break
            if c + 1 < m and _hx_less(I, h + 3 * I[f + c + 1], h + 3 * I[f + c]):
                c += 1
            if not _hx_less(I, h + 3 * I[f + c], h + 3 * I[f + j]):
                break
            I[f + j], I[f + c] = I[f + c], I[f + j]
            j = c
        k = I[h + 3 * i + 2]
        if _is_cand(I, k, part):
            return k
        for c in (2 * i + 1, 2 * i + 2):  # its children join the frontier
            if c < n:
                j = m
                I[f + j] = c
                m += 1
                while j > 0:
                    q = (j - 1) // 2
                    if not _hx_less(I, h + 3 * I[f + j], h + 3 * I[f + q]):
                        break
                    I[f + j], I[f + q] = I[f + q], I[f + j]
                    j = q
    return -1


@_fn
def _list_first(I, li, part):
    """The first candidate of list `li` (-1: none)."""
    k = I[I[O_LST] + 2 * li]
    while k >= 0:
        if _is_cand(I, k, part):
            return k
        k = I[I[O_PK] + k * NPK + PK_NEXT]
    return -1
