"""One mechanism: `moeflow simulate` and `moeflow run` report identical decode counters on the same trace.

A tiny olmoe checkpoint (3 MoE layers x 8 experts, top-2: 24 experts, 6 needed per decode pass) is traced
greedily with `--record-hidden --hidden-dtype float32` (exact router inputs for pre-gating), then run greedily
with the same prompts and max-new-tokens through the offload engine (`--link direct`) for every eviction
policy x prefetch {none, pregate} x 3 capacities, and the trace is replayed by the simulator (instant link)
for the same sweep. Every `decode_counters` field (and, with `--prefill serial`, the prefill path the
simulator replays, every `counters` field, prefill passes included) that does not depend on weights or wall
time (all but `bytes_moved`, which uses the host store's padded row size, and `stall_s`) must be equal.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moeflow.policies import EVICTION
from moeflow.runtime.cache import CacheCounters

CAPACITIES = ("3", "6", "12")  # 12.5%, 25%, 50% of 24 experts: evictions and collision misses at all three
PREFETCHES = ("none", "pregate")
NEW_TOKENS = "8"
COMPARED = [f for f in CacheCounters().to_dict() if f not in ("bytes_moved", "stall_s")]


def _cli(args: list[str]) -> dict:
    from moeflow.cli.app import _register, app

    _register()
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, (args[0], r.output, r.exception)
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def both(tmp_path_factory, tiny_models):
    from tests.test_trace import tiny_tokenizer

    d = tmp_path_factory.mktemp("equiv")
    ck, tr = d / "ck", d / "trace"
    tiny_models("olmoe").save_pretrained(ck)
    tiny_tokenizer().save_pretrained(ck)
    prompts = d / "p.txt"
    prompts.write_text("the cat sat on the mat\nnumbers 1 2 3 4 5\nwhat is the capital of france?\n")
    _cli(
        [
            "trace",
            "--model",
            str(ck),
            "--prompts",
            str(prompts),
            "--out",
            str(tr),
            "--max-new-tokens",
            NEW_TOKENS,
            "--record-hidden",
            "--hidden-dtype",
            "float32",
            "--batch-size",
            "1",  # the routing `moeflow run` sees
            "--json",
        ]
    )
    sweep = [a for c in CAPACITIES for a in ("-c", c)]
    sweep += [a for e in sorted(EVICTION) for a in ("-e", e)]
    sweep += [a for p in PREFETCHES for a in ("-f", p)]
    common = ["--model", str(ck), "--lookahead", "1", "--json"]
    run_args = ["run", "--prompts", str(prompts), "--max-new-tokens", NEW_TOKENS, "--link", "direct", "--miss", "fetch"]
    run_args += ["--sweep", *sweep, *common]  # fetch: the miss policy replayed here (cpu: the test below)
    # the prefill path the simulator replays (the default staged prefill copies in its own order, so the cache it
    # leaves for decode, and hence the decode counters, may differ slightly)
    run = _cli([*run_args, "--prefill", "serial"])
    sim = _cli(["simulate", "--trace", str(tr), "--no-belady", *sweep, *common])
    return run, sim


def test_simulate_and_run_report_identical_decode_counters(both):
    run, sim = both
    got = {(str(r["capacity"]), r["eviction"], r["prefetch"]): r["decode_counters"] for r in sim["rows"]}
    runs = {(r["capacity"], r["eviction"], r["prefetch"]): r for r in run["runs"]}
    assert len(runs) == len(got) == len(CAPACITIES) * len(EVICTION) * len(PREFETCHES)
    evicted = collided = prefetched = 0
    for key, r in runs.items():
        caps = r["capacity_experts"]
        want = r["metrics"]["decode_counters"]
        have = got[(str(caps), key[1], key[2])]
        assert {f: have[f] for f in COMPARED} == {f: want[f] for f in COMPARED}, key
        # every pass, prefill (in waves when a prompt routes more experts than the capacity) included
        whole = next(x for x in sim["rows"] if (x["capacity"], x["eviction"], x["prefetch"]) == (caps, key[1], key[2]))
        assert {f: whole["counters"][f] for f in COMPARED} == {f: r["metrics"]["counters"][f] for f in COMPARED}, key
        evicted += want["evictions"] > 0
        collided += want["collision_misses"] > 0
        prefetched += want["prefetch_issued"] > 0
    # the comparison is not vacuous: real evictions, collision misses and prefetches
    assert evicted == len(runs) and collided > 0 and prefetched == len(runs) // 2


@pytest.fixture(scope="module")
def host_misses(both, tmp_path_factory):
    """The same trace run and replayed with miss policy cpu (and run with auto, cpu's choice on a CPU device), lru and
    least-stale, none and pregate, at the three capacities."""
    from moeflow.cli.app import _register  # noqa: F401  (registered by `both`)

    d = tmp_path_factory.getbasetemp()
    ck = next(d.glob("equiv*/ck"))
    tr, prompts = ck.parent / "trace", ck.parent / "p.txt"
    sweep = [a for c in CAPACITIES for a in ("-c", c)] + ["-e", "lru", "-e", "least-stale"]
    sweep += [a for p in PREFETCHES for a in ("-f", p)]
    common = ["--model", str(ck), "--lookahead", "1", "--json"]
    run_args = ["run", "--prompts", str(prompts), "--max-new-tokens", NEW_TOKENS, "--link", "direct"]
    run_args += ["--sweep", *sweep, *common, "--prefill", "serial"]
    runs = {m: _cli([*run_args, "--miss", m]) for m in ("cpu", "auto")}
    sim = _cli(["simulate", "--trace", str(tr), "--no-belady", "--miss", "cpu", *sweep, *common])
    return runs, sim


def test_simulate_replays_the_host_miss_policy_as_run_runs_it(host_misses):
    runs, sim = host_misses
    got = {(r["capacity"], r["eviction"], r["prefetch"]): r for r in sim["rows"]}
    assert all(r["miss"] == "cpu" and not r["lossy"] for r in sim["rows"])
    hosted = 0
    for m, run in runs.items():
        assert len(run["runs"]) == len(got) == len(CAPACITIES) * 2 * len(PREFETCHES)
        for r in run["runs"]:
            have = got[(r["capacity_experts"], r["eviction"], r["prefetch"])]
            want = r["metrics"]["decode_counters"]
            assert {f: have["decode_counters"][f] for f in COMPARED} == {f: want[f] for f in COMPARED}, (m, r["label"])
            assert {f: have["counters"][f] for f in COMPARED} == {f: r["metrics"]["counters"][f] for f in COMPARED}
            assert have["decode_counters"]["demand_loads"] == 0  # every miss went to the host
            hosted += have["host_misses"] > 0
    assert hosted == 2 * len(got)  # not vacuous: misses the host computed at every capacity
