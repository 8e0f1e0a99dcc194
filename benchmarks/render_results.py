"""Benchmark results: record a study's JSON with the exact command that made it, render docs/results/<study>.md.

    .venv/bin/python benchmarks/render_results.py record least-stale -- \\
        .venv/bin/python benchmarks/least_stale.py --model models/olmoe-mini --prompts 20 --new-tokens 32
    .venv/bin/python benchmarks/render_results.py render           # every docs/results/<study>.md (`make docs`)
    .venv/bin/python benchmarks/render_results.py render --check   # exit 1 naming the stale pages

`record` runs the command from the repository root (its output passes through), takes its JSON (the last
output line that parses as a JSON object, plus each `--attach FILE` the command wrote) and writes
`benchmarks/results/<study>.json`: the command as typed, the seconds it took, the environment (git commit,
versions, CPU, load), the result and the attached files. A benchmark command must name `--model`, so the page says which model
the numbers are of. `render` turns each JSON into a page with the study's renderer below; nothing on a page
is typed by hand, and `tests/test_docs.py` re-renders every page and compares.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
PAGES = REPO / "docs" / "results"
sys.path.insert(0, str(REPO))


# ---- recording --------------------------------------------------------------------------------------------------


def last_json(text: str) -> Any:
    """The last line of `text` that parses as a JSON object (a benchmark's final line, or `--json`'s object)."""
    s = text.strip()
    if s.startswith("{"):
        try:
            return json.loads(s)
        except json.JSONDecodeError:
            pass
    for line in reversed(s.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def check_command(argv: list[str]) -> None:
    """A study's command must say which model it measured."""
    if not any(a == "--model" or a.startswith("--model=") or a == "-m" for a in argv):
        raise SystemExit(
            f"error: the command must name --model (the page says which model its numbers are of): {shlex.join(argv)}"
        )


def record(study: str, argv: list[str], attach: list[str] | None = None) -> Path:
    from moeflow.artifacts import write_json_atomic
    from moeflow.report.env import environment

    check_command(argv)
    env = environment(REPO)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - t0
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"error: the command exited {proc.returncode}; nothing recorded")
    result = last_json(proc.stdout)
    if not isinstance(result, dict):
        raise SystemExit("error: the command printed no JSON object; nothing recorded")
    doc = {
        "study": study,
        "command": shlex.join(argv),
        "seconds": round(seconds, 1),
        "environment": env,
        "result": result,
        "attached": {name: json.loads((REPO / name).read_text()) for name in attach or []},
    }
    path = RESULTS / f"{study}.json"
    write_json_atomic(path, doc)
    return path


# ---- formatting -------------------------------------------------------------------------------------------------


def _f(v: Any, spec: str = ".3f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    return format(v, spec)


def _bytes(n: float | None) -> str:
    if n is None:
        return "—"
    for unit, size in (("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}" if unit == "MB" else f"{n / size:.0f} {unit}"
    return f"{n:.0f} B"


def _table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    """A markdown table; `align` is one letter per column (l or r; default: first left, the rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _on_gpu(doc: dict[str, Any]) -> bool:
    res = doc.get("result") or {}
    return bool((doc.get("environment") or {}).get("gpu")) and (
        res.get("cuda") is True or str(res.get("device", "")).startswith("cuda")
    )


def _measured_on(doc: dict[str, Any]) -> str:
    env = doc.get("environment") or {}
    commit = (env.get("git_commit") or "?")[:7] + (" + local changes" if env.get("git_dirty") else "")
    load = env.get("load_avg_1m")
    return (
        f"Measured {str(env.get('time', '?'))[:10]} at commit {commit} on {env.get('cpu', '?')} "
        f"({env.get('cpu_affinity') or env.get('cpu_cores')} cores, load {_f(load, '.1f')} when it started; "
        f"device {env.get('gpu') if _on_gpu(doc) else env.get('device', 'cpu')}), torch {env.get('torch', '?')}, "
        f"transformers {env.get('transformers', '?')}; "
        f"the command took {doc.get('seconds', 0) / 60:.1f} min." + (f" Note: {env['git_note']}." if env.get("git_note") else "")
    )


def _header(doc: dict[str, Any], title: str, what: str) -> list[str]:
    return [
        f"# {title}",
        "",
        f"<!-- generated by `make docs` from benchmarks/results/{doc['study']}.json; do not edit -->",
        "",
        what,
        "",
        "```bash",
        doc["command"],
        "```",
        "",
        _measured_on(doc),
        "",
    ]


# ---- the studies ------------------------------------------------------------------------------------------------

Renderer = Callable[[dict[str, Any]], str]
STUDIES: dict[str, Renderer] = {}
HEADLINES: dict[str, tuple[str, Renderer]] = {}  # study -> (what it compares, its one-line finding)
README = REPO / "README.md"
BLOCK_BEGIN = "<!-- begin generated: results (make docs) -->"
BLOCK_END = "<!-- end generated: results -->"


def study(name: str) -> Callable[[Renderer], Renderer]:
    def add(fn: Renderer) -> Renderer:
        STUDIES[name] = fn
        return fn

    return add


def headline(name: str, what: str) -> Callable[[Renderer], Renderer]:
    def add(fn: Renderer) -> Renderer:
        HEADLINES[name] = (what, fn)
        return fn

    return add


def headline_table(docs: list[dict[str, Any]]) -> str:
    """The README's table: one row per recorded study with a headline."""
    lines = ["| study | model | finding | details |", "|---|---|---|---|"]
    for doc in docs:
        if doc["study"] not in HEADLINES:
            continue
        what, fn = HEADLINES[doc["study"]]
        model = doc["result"].get("model", "?")
        lines.append(f"| {what} | `{model}` | {fn(doc)} | [docs/results/{doc['study']}.md](docs/results/{doc['study']}.md) |")
    return "\n".join(lines)


def fill_readme(text: str, docs: list[dict[str, Any]]) -> str:
    if BLOCK_BEGIN not in text:
        return text
    head, rest = text.split(BLOCK_BEGIN, 1)
    _, tail = rest.split(BLOCK_END, 1)
    return f"{head}{BLOCK_BEGIN}\n{headline_table(docs)}\n{BLOCK_END}{tail}"


@headline("least-stale", "Least-Stale vs LRU eviction, collision misses (simulated)")
def least_stale_headline(doc: dict[str, Any]) -> str:
    rows = doc["result"]["rows"]

    def get(f: float, config: str) -> dict[str, Any]:
        return next(r for r in rows if r["fraction"] == f and r["config"] == config)

    fractions = sorted({r["fraction"] for r in rows})
    lo, hi = fractions[0], fractions[-1]
    a, b = get(lo, "least-stale+pregate"), get(lo, "lru+pregate")
    c, d = get(hi, "least-stale"), get(hi, "lru")
    return (
        f"at {lo:.0%} with pre-gate: {a['collisions']} (Least-Stale) vs {b['collisions']} (LRU); at {hi:.0%} without "
        f"prefetch {c['collisions']} vs {d['collisions']}, but hit rate {c['hit_rate']:.3f} vs {d['hit_rate']:.3f}"
    )


@study("least-stale")
def least_stale(doc: dict[str, Any]) -> str:
    res = doc["result"]
    rows = res["rows"]
    fractions = sorted({r["fraction"] for r in rows})
    out = _header(
        doc,
        "Least-Stale vs the other evictions (simulated)",
        "SpecMD's Least-Stale eviction against LRU, FLD, score, LRU2 and Belady's MIN on sampled GSM8K decode routing, "
        "replayed through the runtime's own expert cache (`moeflow.sim`), without prefetch and with next-layer pre-gate "
        "prefetch (`+pregate`). A collision miss is an expert evicted and needed again in the same forward pass.",
    )
    out += [
        f"Model `{res['model']}`, {res['passes']} {res['phase']} passes, {res['working_set']:.1f} experts needed per pass.",
        "",
    ]

    def get(f: float, config: str) -> dict[str, Any]:
        return next(r for r in rows if r["fraction"] == f and r["config"] == config)

    summary = []
    for f in fractions:
        cap = get(f, "lru")["capacity"]
        for pf in ("", "+pregate"):
            lru, ls = get(f, "lru" + pf), get(f, "least-stale" + pf)
            summary.append(
                [
                    f"{f:.0%} ({cap} slots)",
                    "pre-gate" if pf else "none",
                    str(lru["collisions"]),
                    str(ls["collisions"]),
                    f"{ls['collisions'] - lru['collisions']:+d}",
                    _f(lru["hit_rate"]),
                    _f(ls["hit_rate"]),
                ]
            )
    out += [
        "## Least-Stale vs LRU",
        "",
        _table(
            [
                "capacity",
                "prefetch",
                "LRU collision misses",
                "Least-Stale collision misses",
                "LS - LRU",
                "LRU hit rate",
                "LS hit rate",
            ],
            summary,
            "llrrrrr",
        ),
        "",
        "Without prefetch, at a capacity at or below one pass's working set every resident expert was used in the "
        "previous pass, so Least-Stale's stale queue in layer order is LRU order and the two evict alike "
        "(`tests/test_sim.py`). Above it Least-Stale's FIFO-by-layer evicts the lowest layers first, which can cut its "
        "collision misses while lowering its hit rate (compare the per-layer hit rates below): a collision avoided in "
        "this pass can become a miss in the next, which the collision metric does not count.",
    ]
    for f in fractions:
        sub = [r for r in rows if r["fraction"] == f]
        out += [
            "",
            f"## Capacity {f:.0%} = {sub[0]['capacity']} experts",
            "",
            _table(
                [
                    "configuration",
                    "hit rate",
                    "collision misses",
                    "misses",
                    "transfers / token",
                    "pf precision",
                    "pf recall",
                    "hit rate per layer",
                ],
                [
                    [
                        f"`{r['config']}`",
                        _f(r["hit_rate"]),
                        str(r["collisions"]),
                        str(r["misses"]),
                        _f(r["loads_per_token"], ".2f"),
                        _f(r["prefetch_precision"], ".2f"),
                        _f(r["prefetch_recall"], ".2f"),
                        " / ".join(f"{h:.2f}" for h in r["hit_rate_per_layer"]),
                    ]
                    for r in sub
                ],
                "lrrrrrrl",
            ),
        ]
    return "\n".join(out)


@headline("cpu-vs-fetch", "host compute (`--miss cpu`) vs copying a missing expert")
def cpu_vs_fetch_headline(doc: dict[str, Any]) -> str:
    res = doc["result"]
    rows = res["rows"]
    wins = [r["gbps"] for r in rows if r["cpu_over_fetch"] is not None and r["cpu_over_fetch"] < 1]
    return (
        f"cpu faster than fetch at {len(wins)} of {len(rows)} link speeds ({rows[0]['gbps']:g}-{rows[-1]['gbps']:g} GB/s); "
        f"{_crossover(res)}; auto / faster {_f(_auto_worst(res), '.2f')} at worst; all token-identical: "
        f"{'yes' if res['token_identical'] else 'NO'}"
    )


def _auto_side(row: dict[str, Any]) -> float | None:
    """auto / the faster of fetch and cpu, measured side by side (older results: from the per-step medians)."""
    return row.get("auto_over_best_side_by_side", row.get("auto_over_best"))


def _auto_worst(res: dict[str, Any]) -> float | None:
    return res.get("auto_over_best_side_by_side_max", res.get("auto_over_best_max"))


def _crossover(res: dict[str, Any]) -> str:
    """The measured cpu/fetch crossover, or that the measured range has none."""
    x = res["measured_crossover_gbps"]
    if x is None:
        return "no crossover in the measured range"
    return f"measured crossover {_f(x, '.2f')} GB/s"


@study("cpu-vs-fetch")
def cpu_vs_fetch(doc: dict[str, Any]) -> str:
    res = doc["result"]
    out = _header(
        doc,
        "CPU compute vs fetch on a miss: the crossover",
        "Where running a missing expert on the host (`--miss cpu`) beats copying it (`--miss fetch`), and how "
        "`--miss auto`'s per-miss choice does, over emulated links of increasing bandwidth. Every miss is a demand "
        f"miss (capacity {res['capacity']} experts, eviction `{res['eviction']}`, prefetch `{res['prefetch']}`); each "
        "configuration runs once untimed, then the three policies run back to back per bandwidth, in an order rotated "
        f"every round ({res.get('rounds', '?')} rounds); a TPOT is the mean over decode steps of each step's median "
        "round; `auto / best` is auto's TPOT over the faster of fetch and cpu measured side by side (each the median "
        "over rounds of the ratio of two runs back to back). The device is the CPU, so "
        "`cpu` and `auto` are exact here and their speed says nothing about a GPU, where host compute is slower and "
        "activations cross PCIe.",
    )
    host = res["host_s"]
    analytic = res["analytic_crossover_gbps"]
    out += [
        f"Model `{res['model']}`: one expert is {res['expert_bytes'] / 1e3:.0f} KB; a copy costs "
        f"{res['latency_us']:g} µs + bytes / bandwidth. All runs token-identical to `fetch`: "
        f"{'yes' if res['token_identical'] else 'NO'}.",
        "",
        "## Host compute of one expert",
        "",
        _table(
            ["tokens per call", "host ms", "analytic crossover GB/s"],
            [[t, _f(1e3 * host[t], ".3f"), _f(analytic.get(t), ".2f")] for t in sorted(host, key=int)],
        ),
        "",
        "Below the analytic crossover a copy costs more than host compute; `auto` applies it per miss.",
        "",
        "## TPOT per link bandwidth",
        "",
        _table(
            ["link GB/s", "fetch TPOT ms", "cpu TPOT ms", "auto TPOT ms", "cpu / fetch", "auto / best", "auto's cpu share"],
            [
                [
                    f"{r['gbps']:g}",
                    _f(1e3 * r["tpot_fetch_s"], ".1f"),
                    _f(1e3 * r["tpot_cpu_s"], ".1f"),
                    _f(1e3 * r["tpot_auto_s"], ".1f"),
                    _f(r["cpu_over_fetch"], ".2f"),
                    _f(_auto_side(r), ".2f"),
                    _f(r["auto_cpu_share"], ".2f"),
                ]
                for r in res["rows"]
            ],
        ),
        "",
        f"Measured crossover (cpu / fetch crossing 1, log-interpolated): {_crossover(res).removeprefix('measured crossover ')}; "
        f"`auto` at worst {_f(_auto_worst(res), '.2f')}x the faster of the two. A `cpu` miss never enters the "
        "cache while a fetched expert earns later hits, which `auto` counts (its learned reuse).",
    ]
    if all("cpu_host_hidden_share" in r for r in res["rows"]):
        out += [
            "",
            "## Overlap and what `auto` modelled",
            "",
            "Hidden: the share of the host worker's busy time that ran while the main thread computed (not waited for). "
            "Wait per miss: measured (fetch: per demand load; cpu: per expert computed on the host); `auto`'s model of "
            "each, and the later hits it expects of a fetched expert.",
            "",
            _table(
                ["GB/s", "cpu hidden", "auto hidden", "fetch wait ms", "cpu wait ms", "auto: cpu ms", "auto: fetch ms", "reuse"],
                [
                    [
                        f"{r['gbps']:g}",
                        _f(r["cpu_host_hidden_share"], ".2f"),
                        _f(r["auto_host_hidden_share"], ".2f"),
                        _f(None if r["fetch_wait_per_miss_s"] is None else 1e3 * r["fetch_wait_per_miss_s"], ".3f"),
                        _f(None if r["cpu_wait_per_miss_s"] is None else 1e3 * r["cpu_wait_per_miss_s"], ".3f"),
                        _f(None if r["auto_model_cpu_s"] is None else 1e3 * r["auto_model_cpu_s"], ".3f"),
                        _f(None if r["auto_model_fetch_s"] is None else 1e3 * r["auto_model_fetch_s"], ".3f"),
                        _f(r["auto_model_reuse"], ".2f"),
                    ]
                    for r in res["rows"]
                ],
            ),
        ]
    out += ["", "TPOT on a shared machine is noisy: compare rows of one run, not runs."]
    return "\n".join(out)


@headline("fidelity", "lossy miss / routing policies: perplexity cost vs TPOT gain")
def fidelity_headline(doc: dict[str, Any]) -> str:
    res = doc["result"]
    table = next(iter(doc["attached"].values()))
    limit = table["args"]["max_ppl_loss"]
    parts = []
    for cap in dict.fromkeys(r["capacity"] for r in table["rows"]):
        ok = [
            r
            for r in table["rows"]
            if r["capacity"] == cap
            and r["lossy"]
            and r["ppl_delta_pct"] is not None
            and r["ppl_delta_pct"] <= limit
            and r.get("vs_fetch_tpot_gain_pct") is not None
        ]
        if ok:
            best = max(ok, key=lambda r: r["vs_fetch_tpot_gain_pct"])
            parts.append(
                f"at {cap} `{best['config']}` {best['ppl_delta_pct']:+.2f}% perplexity for "
                f"{best['vs_fetch_tpot_gain_pct']:+.0f}% TPOT vs `fetch`"
            )
    rec = res.get("recommended")
    if not _has_intervals(doc):
        verdict = "no recommendation: recorded without Δppl intervals; re-record to get one"
    else:
        verdict = f"recommended `{rec['config']}` at {rec['capacity']}" if rec else "no lossy policy beats the best exact one"
    return "; ".join(parts) + f" ({verdict})"


def _has_intervals(doc: dict) -> bool:
    """A fidelity result whose rows (the attached table's) carry a Δppl interval: only such a result may recommend a
    lossy policy."""
    rows = [r for t in doc.get("attached", {}).values() if isinstance(t, dict) for r in t.get("rows", [])]
    return any(isinstance(r, dict) and any(k.startswith("dppl_ci95") for k in r) for r in rows)


@study("fidelity")
def fidelity(doc: dict[str, Any]) -> str:
    res = doc["result"]
    table = doc["attached"][res["table"]] if res.get("table") in doc.get("attached", {}) else next(iter(doc["attached"].values()))
    args, rows = table["args"], table["rows"]
    caps = list(dict.fromkeys(r["capacity"] for r in rows))
    out = _header(
        doc,
        "Fidelity: what each lossy policy costs in quality against what it gains in speed",
        "Every registered miss policy (each precision where a policy takes `bits`), `cache-aware` routing over several "
        "lambdas and `hit-first`, each through `moeflow quality` on a fresh engine: perplexity change and greedy "
        "agreement against the resident model, TPOT and bytes per token of the same run (SpecMD Fig. 7's kind).",
    )
    out += [
        f"Model `{res['model']}`, link `{res['link']}`, eviction `{args['eviction']}` + prefetch `{args['prefetch']}`; "
        f"{args['ppl_windows']} x {args['ppl_tokens']} scored tokens of held-out wikitext2, {args['limit']} "
        f"{args['prompts']} prompts x {args['max_new_tokens']} greedy tokens. `TPOT gain` is relative to `fetch` at the "
        "same capacity (positive: faster). TPOT on a shared machine is noisy; perplexity, agreement and bytes are "
        "stable (they depend on timing only through which prefetches the gate admits).",
        "",
        "![fidelity](../../benchmarks/results/fidelity/fidelity.png)",
        "",
    ]
    by = {(r["config"], r["capacity"]): r for r in rows}
    configs = list(dict.fromkeys(r["config"] for r in rows))
    header = ["configuration", "output"]
    for c in caps:
        header += [f"{c}: Δppl % [95% CI]", f"{c}: agree", f"{c}: TPOT gain vs fetch", f"{c}: bytes/token"]
    body = []
    for name in configs:
        any_row = next(by[(name, c)] for c in caps if (name, c) in by)
        line = [f"`{name}`", "LOSSY" if any_row["lossy"] else "exact"]
        for c in caps:
            r = by.get((name, c))
            if r is None:
                line += ["—"] * 4
                continue
            gain = r.get("vs_fetch_tpot_gain_pct")
            ci = r.get("dppl_ci95")
            line += [
                _f(r["ppl_delta_pct"], "+.2f") + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else ""),
                _f(r["agreement"], ".3f"),
                "—" if gain is None else f"{gain:+.0f}%",
                _bytes(r["bytes_per_token"]),
            ]
        body.append(line)
    out += [_table(header, body, "ll" + "rrrr" * len(caps)), ""]
    rec = res.get("recommended")
    if not _has_intervals(doc):
        out.append(
            "Recommended: none. This result was recorded before each Δppl carried a 95% interval, so a difference "
            "here may be inside the noise; re-record it (the command above) for a recommendation."
        )
    elif rec:
        out.append(
            f"Recommended (the fastest lossy configuration losing at most {args['max_ppl_loss']:g}% perplexity and faster "
            f"than the best exact one at its capacity): `{rec['config']}` at {rec['capacity']}, "
            f"Δppl {_f(res['ppl_delta_pct'], '+.2f')}%, TPOT gain {_f(res['tpot_gain_pct'], '+.1f')}% over the best exact "
            "configuration there."
        )
    else:
        out.append(
            f"Recommended: none. No lossy configuration lost at most {args['max_ppl_loss']:g}% perplexity while being faster "
            "than the best exact configuration at its capacity (on a CPU device that is often `cpu` or `auto`, which move "
            "no weights)."
        )
    return "\n".join(out)


@headline("gpu-check", "`make gpu-check` on a GPU: gpu tests and GPU benchmarks")
def gpu_check_headline(doc: dict[str, Any]) -> str:
    res = doc["result"]
    by = {c["check"]: c for c in res.get("checks", [])}
    tests = by.get("pytest -m gpu", {})
    parts = [f"{res.get('device', '?')}: gpu tests {tests.get('figure') or tests.get('status', '?')}"]
    parts += [by[k]["figure"] for k in ("engine overhead", "prefill") if by.get(k, {}).get("figure")]
    return "; ".join(parts) + ("" if res.get("ok") else "; FAILED")


@study("gpu-check")
def gpu_check(doc: dict[str, Any]) -> str:
    res = doc["result"]
    out = _header(
        doc,
        "`make gpu-check` on a GPU",
        f"Every test marked `gpu` and the GPU benchmarks (`benchmarks/gpu_check.py`{' --quick' if res.get('quick') else ''}) "
        f"on {res.get('device', '?')} ({res.get('gpus', '?')} GPU), torch {res.get('torch', '?')}, transformers "
        f"{res.get('transformers', '?')}: {'all passed' if res.get('ok') else 'FAILED'}. Each benchmark's figures are "
        "ratios from one run on that machine.",
    )
    rows = [
        [
            c["check"],
            c["status"],
            f"{c.get('seconds', 0):.0f}",
            (c.get("figure") or "-") + (f" ({c['reason']})" if c.get("reason") else ""),
        ]
        for c in res.get("checks", [])
    ]
    out += [_table(["check", "status", "s", "key figure"], rows, "llrl"), ""]
    return "\n".join(out)


def render(doc: dict[str, Any]) -> str:
    fn = STUDIES.get(doc["study"])
    if fn is None:
        raise SystemExit(f"error: no renderer for study {doc['study']!r} (known: {', '.join(sorted(STUDIES))})")
    return fn(doc).rstrip("\n") + "\n"


def render_all(check: bool = False) -> list[str]:
    """Write (or with `check`, compare) every page and the README's results table; the stale files' paths."""
    docs = [json.loads(path.read_text()) for path in sorted(RESULTS.glob("*.json"))]
    todo = {PAGES / f"{doc['study']}.md": render(doc) for doc in docs}
    if README.exists():
        todo[README] = fill_readme(README.read_text(), docs)
    stale = []
    for page, text in todo.items():
        if page.exists() and page.read_text() == text:
            continue
        stale.append(str(page.relative_to(REPO)))
        if not check:
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_text(text)
    return stale


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="run a study's command (after --) and record its JSON")
    rec.add_argument("study", help="the study's name: benchmarks/results/<study>.json, docs/results/<study>.md")
    rec.add_argument(
        "--attach", action="append", default=[], help="a JSON file the command writes, kept with the result (repeatable)"
    )
    ren = sub.add_parser("render", help="render docs/results/<study>.md from every benchmarks/results/<study>.json")
    ren.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page is stale")
    argv = sys.argv[1:] if argv is None else argv
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.cmd == "record":
        if not command:
            ap.error("give the command after --")
        print(f"recorded {record(args.study, command, args.attach).relative_to(REPO)}", file=sys.stderr)
        return 0
    stale = render_all(check=args.check)
    if args.check and stale:
        print(f"stale: {', '.join(stale)}; run `make docs`", file=sys.stderr)
        return 1
    for page in stale:
        print(f"wrote {page}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.chdir(REPO)
    raise SystemExit(main())
