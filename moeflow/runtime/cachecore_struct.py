"""The compiled cache core's small structures over the flat state array `I` (`I[section offset + i]`): the
call's record log, doubly linked key lists (lru order, least-stale's queues), lfu's count buckets and the
indexed heap of victim candidates (belady)."""

from __future__ import annotations

from .cachecore_layout import (
    H_KIND,
    H_LOGON,
    H_PARTS,
    H_PERLAYER,
    KIND_LFU,
    KIND_MIN,
    NPK,
    O_BK,
    O_BKF,
    O_BKH,
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
    PG_NBFREE,
    PK_BKC,
    PK_BKT,
    PK_CNT,
    PK_HA,
    PK_HB,
    PK_NEXT,
    PK_PREV,
    PK_TR,
    SC_NLOG,
    _fn,
    _inline,
    _u,
)


@_inline
def _log(I, op, s, k, arg):
    if I[H_LOGON]:
        sc = I[O_SC]
        n = I[_u(sc + SC_NLOG)]
        b = I[O_LOG] + 4 * n
        I[_u(b)], I[_u(b + 1)], I[_u(b + 2)], I[_u(b + 3)] = op, s, k, arg
        I[_u(sc + SC_NLOG)] = n + 1


@_inline
def _ll_unlink(I, li, k):
    lst = I[O_LST] + 2 * li
    prev, nxt = I[_u(I[O_PK] + k * NPK + PK_PREV)], I[_u(I[O_PK] + k * NPK + PK_NEXT)]
    if prev >= 0:
        I[_u(I[O_PK] + prev * NPK + PK_NEXT)] = nxt
    else:
        I[_u(lst)] = nxt
    if nxt >= 0:
        I[_u(I[O_PK] + nxt * NPK + PK_PREV)] = prev
    else:
        I[_u(lst + 1)] = prev
    I[_u(I[O_PK] + k * NPK + PK_PREV)] = -1
    I[_u(I[O_PK] + k * NPK + PK_NEXT)] = -1


@_inline
def _ll_append(I, li, k):
    lst = I[O_LST] + 2 * li
    tail = I[_u(lst + 1)]
    I[_u(I[O_PK] + k * NPK + PK_PREV)] = tail
    I[_u(I[O_PK] + k * NPK + PK_NEXT)] = -1
    if tail >= 0:
        I[_u(I[O_PK] + tail * NPK + PK_NEXT)] = k
    else:
        I[_u(lst)] = k
    I[_u(lst + 1)] = k


# lfu's count buckets: per part (the whole cache, or a layer with per-layer partitions) a list of buckets by
# ascending count (O_BKH: the first, then the last), each a doubly linked list of keys (PK_PREV, PK_NEXT) by ascending tick.
# A touch makes a key's tick the newest, so it joins the END of its count's bucket: the order is lfu's
# (count, tick) without a comparison. Every resident key is in its bucket from its first access or its
# prefetch on, pinned ones too; a bucket counts its candidates (PK_BKC: the key is counted), so the victim
# search passes over buckets of pinned or just issued keys (a step's fresh loads: the least counts) at once.
# A key is touched only while pinned (an access) or just issued (a prefetch's insert): it joins its bucket
# uncounted, and is counted when `_hx_insert` makes it a candidate again (unpinned, its prefetch call over).


@_inline
def _bk_part(I, k):
    return I[_u(I[O_KR] + k)] if I[H_PERLAYER] else 0


@_fn
def _bk_new(I, c, prev, nxt, part):
    """A new empty bucket of count c between buckets prev and nxt (-1: none) of part's list."""
    pg, bk = I[O_PG], I[O_BK]
    n = I[_u(pg + PG_NBFREE)] - 1
    I[_u(pg + PG_NBFREE)] = n
    b = I[_u(I[O_BKF] + n)]
    x = bk + 6 * b
    I[_u(x)], I[_u(x + 1)], I[_u(x + 2)], I[_u(x + 3)], I[_u(x + 4)], I[_u(x + 5)] = c, -1, -1, prev, nxt, 0
    if prev >= 0:
        I[_u(bk + 6 * prev + 4)] = b
    else:
        I[_u(I[O_BKH] + part)] = b
    if nxt >= 0:
        I[_u(bk + 6 * nxt + 3)] = b
    else:
        I[_u(I[O_BKH] + I[H_PARTS] + part)] = b
    return b


@_fn
def _bk_append(I, k, b):
    """Key k (in no bucket; pinned or just issued: not counted) joins the end of bucket b."""
    x, pk = I[O_BK] + 6 * b, I[O_PK] + k * NPK
    tail = I[_u(x + 2)]
    I[_u(pk + PK_PREV)] = tail
    I[_u(pk + PK_NEXT)] = -1
    I[_u(pk + PK_BKT)] = b
    if tail >= 0:
        I[_u(I[O_PK] + tail * NPK + PK_NEXT)] = k
    else:
        I[_u(x + 1)] = k
    I[_u(x + 2)] = k


@_fn
def _bk_unlink(I, k):
    """Key k leaves its bucket; an emptied bucket leaves its part's list."""
    pk = I[O_PK] + k * NPK
    b = I[_u(pk + PK_BKT)]
    if b < 0:
        return
    bk = I[O_BK]
    x = bk + 6 * b
    I[_u(x + 5)] -= I[_u(pk + PK_BKC)]
    I[_u(pk + PK_BKC)] = 0
    prev, nxt = I[_u(pk + PK_PREV)], I[_u(pk + PK_NEXT)]
    if prev >= 0:
        I[_u(I[O_PK] + prev * NPK + PK_NEXT)] = nxt
    else:
        I[_u(x + 1)] = nxt
    if nxt >= 0:
        I[_u(I[O_PK] + nxt * NPK + PK_PREV)] = prev
    else:
        I[_u(x + 2)] = prev
    I[_u(pk + PK_PREV)] = -1
    I[_u(pk + PK_NEXT)] = -1
    I[_u(pk + PK_BKT)] = -1
    if I[_u(x + 1)] < 0:
        bp, bn = I[_u(x + 3)], I[_u(x + 4)]
        if bp >= 0:
            I[_u(bk + 6 * bp + 4)] = bn
        else:
            I[_u(I[O_BKH] + _bk_part(I, k))] = bn
        if bn >= 0:
            I[_u(bk + 6 * bn + 3)] = bp
        else:
            I[_u(I[O_BKH] + I[H_PARTS] + _bk_part(I, k))] = bp
        pg = I[O_PG]
        I[_u(I[O_BKF] + I[_u(pg + PG_NBFREE)])] = b
        I[_u(pg + PG_NBFREE)] += 1


@_fn
def _bk_touch(I, k):
    """Key k was just touched (its tick the newest): to the end of its count's bucket. A key in a bucket
    moves up from the bucket of count - 1 (an access: its count + 1), a new one is placed by its count."""
    pk = I[O_PK] + k * NPK
    c, b, bk = I[_u(pk + PK_CNT)], I[_u(pk + PK_BKT)], I[O_BK]
    part = _bk_part(I, k)
    if b >= 0:
        x = bk + 6 * b
        nb = I[_u(x + 4)]
        if nb >= 0 and I[_u(bk + 6 * nb)] == c:
            _bk_unlink(I, k)
            _bk_append(I, k, nb)
        elif I[_u(x + 1)] == k and I[_u(x + 2)] == k:  # alone in its bucket: the bucket takes the new count
            I[_u(x)] = c
        else:
            _bk_unlink(I, k)  # b keeps other keys
            _bk_append(I, k, _bk_new(I, c, b, nb, part))
        return
    # its place from both ends at once (a reloaded key's count is often far from the least): from the first
    # bucket, the first of count >= c; from the last, the last of count <= c; whichever comes first
    f, g = I[_u(I[O_BKH] + part)], I[_u(I[O_BKH] + I[H_PARTS] + part)]
    prev, nxt = -1, -1
    while f >= 0:  # g >= 0 too: both ends exist or neither; the walks meet before either runs off its end
        if I[_u(bk + 6 * f)] >= c:
            prev, nxt = I[_u(bk + 6 * f + 3)], f
            break
        if I[_u(bk + 6 * g)] <= c:
            prev, nxt = g, I[_u(bk + 6 * g + 4)]
            break
        f, g = I[_u(bk + 6 * f + 4)], I[_u(bk + 6 * g + 3)]
    if prev >= 0 and I[_u(bk + 6 * prev)] == c:
        b = prev
    elif nxt >= 0 and I[_u(bk + 6 * nxt)] == c:
        b = nxt
    else:
        b = _bk_new(I, c, prev, nxt, part)
    _bk_append(I, k, b)


@_fn
def _bk_first(I, part):
    """lfu's victim: the first candidate of part's buckets, by count then tick (-1: none)."""
    bk = I[O_BK]
    b = I[_u(I[O_BKH] + part)]
    while b >= 0:
        if I[_u(bk + 6 * b + 5)] > 0:  # a candidate in this bucket
            k = I[_u(bk + 6 * b + 1)]
            while k >= 0:
                if _is_cand(I, k, part):
                    return k
                k = I[_u(I[O_PK] + k * NPK + PK_NEXT)]
        b = I[_u(bk + 6 * b + 4)]
    return -1


@_inline
def _bk_hold(I, k):
    """Key k is pinned: no longer counted among its bucket's candidates."""
    pk = I[O_PK] + k * NPK
    if I[_u(pk + PK_BKC)]:
        I[_u(pk + PK_BKC)] = 0
        I[_u(I[O_BK] + 6 * I[_u(pk + PK_BKT)] + 5)] -= 1


@_inline
def _bk_free(I, k):
    """lfu: key k (resident) is a candidate again: unpinned, or its prefetch call over."""
    pk = I[O_PK] + k * NPK
    b = I[_u(pk + PK_BKT)]
    if b >= 0 and not I[_u(pk + PK_BKC)]:
        I[_u(pk + PK_BKC)] = 1
        I[_u(I[O_BK] + 6 * b + 5)] += 1


# The heap (belady): an indexed min-heap of resident keys, one entry (a, b, key) each at I[O_HEAP], ordered
# by (a, b), unique among keys ((-score, 0), a score names its key); O_HPOS holds each key's position (-1: out
# of the heap), so an update sifts it in place. Every tracked key keeps its entry in PK_HA, PK_HB. Every
# candidate is in the heap with that entry; a pinned or just issued key stays where it is with the entry it
# had (an access re-scores only PK_HA: its heap entry, a next use now, sits far from the top) until it is a
# candidate again (`_hx_insert`: one sift to its new entry) or a victim search meets it at the top, which
# takes it out (`_hx_first`); a key out of the heap is not entered while pinned or just issued, and comes back
# with `_hx_insert`. The victim is the first entry whose key is a candidate.


@_inline
def _hx_less(I, x, y):
    """The heap entry at I[_u(x)] is less than the one at I[_u(y)] (by (a, b))."""
    return I[_u(x)] < I[_u(y)] or (I[_u(x)] == I[_u(y)] and I[_u(x + 1)] < I[_u(y + 1)])


@_fn
def _hx_sift(I, i):
    """Restore the heap order around position i: its entry moves up, else down, parents or children moving
    into the hole it leaves."""
    h, n, hp = I[O_HEAP], I[_u(I[O_PG] + PG_HSIZE)], I[O_HPOS]
    a, b, k = I[_u(h + 3 * i)], I[_u(h + 3 * i + 1)], I[_u(h + 3 * i + 2)]
    j = i
    while j > 0:
        q = (j - 1) // 2
        y = h + 3 * q
        if not (a < I[_u(y)] or (a == I[_u(y)] and b < I[_u(y + 1)])):
            break
        x = h + 3 * j
        I[_u(x)], I[_u(x + 1)], I[_u(x + 2)] = I[_u(y)], I[_u(y + 1)], I[_u(y + 2)]
        I[_u(hp + I[_u(x + 2)])] = j
        j = q
    if j == i:
        while True:
            c = 2 * j + 1
            if c >= n:
                break
            y = h + 3 * c
            if c + 1 < n and _hx_less(I, y + 3, y):  # the right child's entry is less
                c += 1
                y += 3
            if not (I[_u(y)] < a or (I[_u(y)] == a and I[_u(y + 1)] < b)):
                break
            x = h + 3 * j
            I[_u(x)], I[_u(x + 1)], I[_u(x + 2)] = I[_u(y)], I[_u(y + 1)], I[_u(y + 2)]
            I[_u(hp + I[_u(x + 2)])] = j
            j = c
    x = h + 3 * j
    I[_u(x)], I[_u(x + 1)], I[_u(x + 2)] = a, b, k
    I[_u(hp + k)] = j


@_fn
def _hx_put(I, k, a, b):
    """Key k (not in the heap) enters with entry (a, b)."""
    h, pg = I[O_HEAP], I[O_PG]
    i = I[_u(pg + PG_HSIZE)]
    I[_u(pg + PG_HSIZE)] = i + 1
    I[_u(I[O_HPOS] + k)] = i
    x = h + 3 * i
    I[_u(x)], I[_u(x + 1)], I[_u(x + 2)] = a, b, k
    _hx_sift(I, i)


@_fn
def _hx_set(I, k, a, b):
    """Key k's entry is now (a, b); a candidate's is sifted in place or entered. A pinned or just issued key's
    heap entry (if any) keeps its old value until `_hx_insert`: one sift when it is a candidate again, and
    meanwhile the old entry (an access's key: a next use now, the farthest from the top) keeps it out of the
    victim search's way."""
    pk = I[O_PK] + k * NPK
    I[_u(pk + PK_HA)] = a
    I[_u(pk + PK_HB)] = b
    s = I[_u(I[O_SOF] + k)]
    if s < 0 or I[_u(I[O_PIN] + s)] or I[_u(I[O_PROT] + s)]:  # not a candidate: its heap entry, if any, waits
        return
    i = I[_u(I[O_HPOS] + k)]
    if i >= 0:
        x = I[O_HEAP] + 3 * i
        I[_u(x)] = a
        I[_u(x + 1)] = b
        _hx_sift(I, i)
    else:
        _hx_put(I, k, a, b)


@_fn
def _hx_remove(I, k):
    h, pg, at = I[O_HEAP], I[O_PG], I[O_HPOS] + k
    i = I[_u(at)]
    if i < 0:
        return
    n = I[_u(pg + PG_HSIZE)] - 1
    I[_u(at)] = -1
    I[_u(pg + PG_HSIZE)] = n
    if i != n:
        for t in range(3):
            I[_u(h + 3 * i + t)] = I[_u(h + 3 * n + t)]
        I[_u(I[O_HPOS] + I[_u(h + 3 * i + 2)])] = i
        _hx_sift(I, i)


@_inline
def _hx_hold(I, k):
    """Key k is pinned: lfu: not counted in its bucket until `_hx_insert` (belady: it stays where it is in the
    heap until a victim search meets it at the top)."""
    if I[H_KIND] == KIND_LFU:
        _bk_hold(I, k)


@_inline
def _hx_insert(I, k):
    """Resident key k is a candidate again: lfu: counted in its bucket; belady: into the heap with its entry
    if it is not there (a tracked key only: a demand load's entry is set by the access that follows)."""
    kind = I[H_KIND]
    if kind == KIND_LFU:
        _bk_free(I, k)
    elif kind == KIND_MIN and I[_u(I[O_PK] + k * NPK + PK_TR)]:
        pk = I[O_PK] + k * NPK
        a, b, i = I[_u(pk + PK_HA)], I[_u(pk + PK_HB)], I[_u(I[O_HPOS] + k)]
        if i < 0:
            _hx_put(I, k, a, b)
            return
        x = I[O_HEAP] + 3 * i
        if I[_u(x)] != a or I[_u(x + 1)] != b:  # re-scored while pinned: its entry now
            I[_u(x)] = a
            I[_u(x + 1)] = b
            _hx_sift(I, i)


@_inline
def _is_cand(I, k, part):
    """A victim candidate of `part`: resident, not pinned, not issued by the running prefetch call."""
    s = I[_u(I[O_SOF] + k)]
    if s < 0 or I[_u(I[O_PIN] + s)] or I[_u(I[O_PROT] + s)]:
        return False
    return not I[H_PERLAYER] or I[_u(I[O_KR] + k)] == part


@_fn
def _hx_first(I, part):
    """The smallest entry whose key is a candidate (-1: none): pinned or just issued keys at the top leave the
    heap; then the top, or (per-layer partitions, the top another part's) best-first over the heap, a frontier
    of positions (a small heap at I[O_HSKIP]) holding the children of the non-candidates passed."""
    h, f = I[O_HEAP], I[O_HSKIP]
    while I[_u(I[O_PG] + PG_HSIZE)] > 0:  # a pinned or just issued key at the top leaves the heap until `_hx_insert`
        k = I[_u(h + 2)]
        s = I[_u(I[O_SOF] + k)]
        if not I[_u(I[O_PIN] + s)] and not I[_u(I[O_PROT] + s)]:
            if not I[H_PERLAYER] or I[_u(I[O_KR] + k)] == part:
                return k
            break
        _hx_remove(I, k)
    n = I[_u(I[O_PG] + PG_HSIZE)]
    if n == 0:
        return -1
    m = 1
    I[_u(f)] = 0
    while m > 0:
        i = I[_u(f)]  # the frontier's smallest position; pop it
        m -= 1
        I[_u(f)] = I[_u(f + m)]
        j = 0
        while True:
            c = 2 * j + 1
            if c >= m:
                break
            y = h + 3 * I[_u(f + c)]
            if c + 1 < m:
                x = h + 3 * I[_u(f + c + 1)]
                if _hx_less(I, x, y):
                    c += 1
                    y = x
            x = h + 3 * I[_u(f + j)]
            if not _hx_less(I, y, x):
                break
            I[_u(f + j)], I[_u(f + c)] = I[_u(f + c)], I[_u(f + j)]
            j = c
        k = I[_u(h + 3 * i + 2)]
        if _is_cand(I, k, part):
            return k
        for c in (2 * i + 1, 2 * i + 2):  # its children join the frontier
            if c < n:
                j = m
                I[_u(f + j)] = c
                m += 1
                while j > 0:
                    q = (j - 1) // 2
                    if not _hx_less(I, h + 3 * I[_u(f + j)], h + 3 * I[_u(f + q)]):
                        break
                    I[_u(f + j)], I[_u(f + q)] = I[_u(f + q)], I[_u(f + j)]
                    j = q
    return -1


@_inline
def _list_first(I, li, part):
    """The first candidate of list `li` (-1: none)."""
    k = I[_u(I[O_LST] + 2 * li)]
    while k >= 0:
        if _is_cand(I, k, part):
            return k
        k = I[_u(I[O_PK] + k * NPK + PK_NEXT)]
    return -1
