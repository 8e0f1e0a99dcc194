"""`RunConfig`: everything `moeflow run` needs, frozen; the CLI only maps flags to it.

`RunConfig(...)` checks every value that the flags alone decide (every item of every --sweep list:
modes, capacity syntax, eviction / prefetch names and options, the link), so a bad late value fails
before the first run; `preflight()` checks the device and `--out` before the model loads; the
capacities that need the model (below top-k, above all experts) are checked by `moeflow.stages.session` after it
loads and before the first generation."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..policies import DEFAULT_EVICTION
from ..policies.parse import build_policy, check_capacity_syntax, opts_dict, parse_capacity, parse_opts, policy_args, split_list  # noqa: F401  (their one home)

if TYPE_CHECKING:
    from ..policies.lossy import Lossy

MODES = ("offload", "resident", "on-demand")
LOAD_EXPERTS = ("auto", "device", "host")  # where the routed experts' weights load (`experts_placement`)
EXPERTS_IMPLS = ("auto", "batched_mm", "grouped_mm")  # resident's stock experts implementation (auto: measured)
PREFILL_PATHS = ("staged", "serial")  # moeflow.runtime.prefill.PREFILL_PATHS (no runtime import for the flags)


@dataclass(frozen=True)
class RunConfig:
    model: str
    prompts: str | None = None  # file, short set name or HF dataset (moeflow.data.load_prompts)
    prompt: tuple[str, ...] = ()  # literal prompt texts (--prompt, repeatable)
    data_dir: str | None = None
    split: str | None = None  # split of a prompt set name (e.g. gsm8k: train/test)
    limit: int | None = None  # at most this many prompts
    max_prompt_tokens: int = 256  # longer prompts are truncated (first tokens kept)
    max_new_tokens: int = 32
    min_new_tokens: int | None = None  # set to max_new_tokens to ignore EOS (equal-length outputs)
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0
    modes: tuple[str, ...] = ("offload",)  # offload | resident | on-demand (several with --sweep)
    capacities: tuple[str, ...] = ("25%",)  # N experts, P% of all routed experts, or bytes (64MB)
    per_layer_cache: bool = False
    evictions: tuple[str, ...] = (DEFAULT_EVICTION,)  # the measured default: fewest transfers on held-out prompts
    prefetches: tuple[str, ...] = ("pregate",)
    eviction_opts: tuple[tuple[str, str], ...] = ()
    prefetch_opts: tuple[tuple[str, str], ...] = ()
    miss: str = "fetch"
    routing: str = "standard"
    miss_opts: tuple[tuple[str, str], ...] = ()  # --miss-opt key=value (drop: min_rank, score, renorm; ...)
    routing_opts: tuple[tuple[str, str], ...] = ()  # --routing-opt key=value (cache-aware: lambda)
    link: str = "auto"  # auto | cuda | direct | emulated:GBPS[,LATENCY_US]
    lookahead: int | None = None  # step size S; None = calibration's, else 1
    calibration: str | None = None  # calibration JSON; None = calibration/<device>.json
    dtype: str = "auto"
    device: str = "cpu"
    threads: int | None = None  # torch intra-op threads (None: the rule of moeflow.threads)
    out: str | None = None  # JSONL: one line per prompt and run
    json: bool = False
    progress: bool = True  # the progress display (moeflow.progress); --no-progress: False
    sweep: bool = False
    adaptive_s: bool = False  # ExpertFlow's adaptive step size (stall / overfetch counters)
    speculative: bool = False  # LOSSY: run the predicted experts instead of the router's
    column: str | None = None  # prompt column of a CSV/TSV/JSON prompt file (None: auto)
    force: bool = False  # replace an existing `moeflow run` JSONL at `out`
    wait: bool = False  # wait for another writer of `out` instead of refusing (moeflow.locks.out_lock)
    batch_size: int = 1  # prompts decoded together (left-padded)
    warmup: bool = True  # one untimed short generation per run before the timed one
    prefill: str = "staged"  # prefill path of engine runs: staged | serial (moeflow.runtime.prefill)
    load_experts: str = "auto"  # auto | device | host: where the routed experts load (host: never on the device)
    experts_impl: str = "auto"  # resident: auto (fastest of batched_mm / grouped_mm, measured) or a name
    plan: str | None = None  # --plan casmoe: CasMoE's prompt-level plan (moeflow.plan.run)
    plan_opts: tuple[tuple[str, str], ...] = ()  # --plan-opt key=value (predictors, mode, eps, k, mass, renorm, update, buffer)
    config: str | None = None  # --config: the run configuration file (`moeflow tune --out`) applied to these fields
    config_fingerprint: str | None = None  # the model that file was tuned for (checked once the model loads)
    config_keys: tuple[str, ...] = ()  # the options that file set (`applied_keys`): e.g. S said to come from it

    def __post_init__(self) -> None:
        for m in self.modes:
            if m not in MODES:
                raise ConfigError(f"--mode {m!r} unknown; use one of {', '.join(MODES)}")
        if not self.modes or not self.capacities or not self.evictions or not self.prefetches:
            raise ConfigError("--mode, --capacity, --eviction and --prefetch need at least one value each")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1 (got {self.max_new_tokens})")
        if self.min_new_tokens is not None and not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ConfigError(
                f"--min-new-tokens {self.min_new_tokens} must be between 0 and --max-new-tokens "
                f"({self.max_new_tokens}); raise --max-new-tokens or lower --min-new-tokens"
            )
        if self.max_prompt_tokens < 1:
            raise ConfigError(f"--max-prompt-tokens must be >= 1 (got {self.max_prompt_tokens})")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1 (got {self.limit})")
        if self.lookahead is not None and self.lookahead < 1:
            raise ConfigError(f"--lookahead must be >= 1 (got {self.lookahead})")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1 (got {self.batch_size})")
        if self.load_experts not in LOAD_EXPERTS:
            raise ConfigError(f"--load-experts {self.load_experts!r} unknown; use one of {', '.join(LOAD_EXPERTS)}")
        if self.load_experts == "host":  # a resident run beside it: refused here, by the rule the load follows
            experts_placement("host", self.device.split(":")[0], None, None, "resident" in self.modes)
        if self.prefill not in PREFILL_PATHS:
            raise ConfigError(f"--prefill {self.prefill!r} unknown; use one of {', '.join(PREFILL_PATHS)}")
        if self.experts_impl not in EXPERTS_IMPLS:
            raise ConfigError(f"--experts-impl {self.experts_impl!r} unknown; use one of {', '.join(EXPERTS_IMPLS)}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1 (got {self.threads})")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0 (0 = greedy; got {self.temperature})")
        if not self.sweep and max(len(self.modes), len(self.capacities), len(self.evictions), len(self.prefetches)) > 1:
            raise ConfigError("several modes / capacities / evictions / prefetches need --sweep")
        if not self.prompts and not self.prompt:
            raise ConfigError("give --prompts FILE|NAME or --prompt TEXT")
        if any(not p.strip() for p in self.prompt):  # a model generates from nothing but its BOS token
            raise ConfigError("--prompt is empty: give the text to generate from")
        self._check_policies()
        self._check_plan()
        if self.adaptive_s and "offload" in self.modes and not any(_proposes(p) for p in self.prefetches):
            raise ConfigError("--adaptive-s adapts the prefetch step size S: give a prefetch policy (-f pregate, ...) or drop it")
        if self.speculative and (set(self.modes) != {"offload"} or not all(_speculates(p) for p in self.prefetches)):
            raise ConfigError(
                "--speculative needs --mode offload --prefetch router-pf|estimator|hybrid "
                "--prefetch-opt predictors=DIR (for every run of a sweep)"
            )

    def _check_policies(self) -> None:
        """Every capacity's syntax, every eviction / prefetch with its options, miss, routing and link."""
        from ..policies import EVICTION, MISS, PREFETCH, ROUTING
        from ..runtime.link import parse_link

        offload = "offload" in self.modes
        if offload:
            for c in self.capacities:
                check_capacity_syntax(c)
            for text in self.evictions:
                build_policy(EVICTION, text, self.eviction_opts)
            for text in self.prefetches:
                build_policy(PREFETCH, text, self.prefetch_opts)
        build_policy(MISS, self.miss, self.miss_opts)
        build_policy(ROUTING, self.routing, self.routing_opts)
        kind, _, _ = parse_link(self.link)
        if kind == "cuda" and not self.device.startswith("cuda"):
            raise ConfigError("--link cuda needs --device cuda; on CPU use --link direct or emulated:GBPS[,LATENCY_US]")

    def _check_plan(self) -> None:
        from ..plan.run import parse_plan

        spec = parse_plan(self.plan, self.plan_opts, self.prefetch_opts)
        if self.routing.split(":")[0] == "plan-restricted":
            raise ConfigError("--routing plan-restricted is set by --plan casmoe --plan-opt mode=restricted")
        if spec is None:
            return
        if "offload" not in self.modes:
            raise ConfigError("--plan casmoe needs --mode offload (resident and on-demand runs keep no plan)")
        if spec.lossy and self.routing != "standard":
            raise ConfigError("--plan-opt mode=restricted replaces the routing policy; drop --routing")
        if spec.lossy and self.speculative:
            raise ConfigError("--plan-opt mode=restricted and --speculative both change routing; pick one")

    def plan_spec(self) -> Any:
        """The checked `moeflow.plan.run.PlanSpec`, or None without --plan."""
        from ..plan.run import parse_plan

        return parse_plan(self.plan, self.plan_opts, self.prefetch_opts)

    def lossy(self, device_type: str, run: dict[str, Any] | None = None) -> Lossy:
        """Whether a run of this configuration on a `device_type` device can change the model's output: the one
        answer (`moeflow.policies.lossy.Lossy`: `lossy`, `reasons`) from the built policies, `--speculative` and
        a restricted `--plan` (whose routing is `plan-restricted`). `run`: one run of `moeflow.stages.session.plan_runs`
        (its mode, eviction, prefetch); None: every run (lossy when any is). Resident and on-demand runs run
        the router's experts, loaded: exact."""
        from ..policies import EVICTION, MISS, PREFETCH, ROUTING
        from ..policies.lossy import EXACT, lossy

        if (run is not None and run.get("mode") != "offload") or "offload" not in self.modes:
            return EXACT
        evictions = [run["eviction"]] if run is not None and run.get("eviction") else list(self.evictions)
        prefetches = [run["prefetch"]] if run is not None and run.get("prefetch") else list(self.prefetches)
        spec = self.plan_spec()
        if spec is not None and spec.lossy:
            routing = ROUTING.create("plan-restricted", renorm=spec.renorm)
        else:
            routing = build_policy(ROUTING, self.routing, self.routing_opts)
        return lossy(
            device_type=device_type,
            eviction=[build_policy(EVICTION, t, self.eviction_opts) for t in evictions],
            prefetch=[build_policy(PREFETCH, t, self.prefetch_opts) for t in prefetches],
            miss=build_policy(MISS, self.miss, self.miss_opts),
            routing=routing,
            speculative=self.speculative,
        )

    def preflight(self) -> None:
        """What depends on this machine and disk, checked before anything loads: the device, `--out`."""
        from pathlib import Path

        from ..checks import check_device
        from ..outputs import check_out

        check_device(self.device)
        spec = self.plan_spec()
        if spec is not None:
            from ..plan.run import check_plan_folder

            check_plan_folder(spec)
        if self.out:
            inputs = (self.model, self.calibration, self.prompts if self.prompts and Path(self.prompts).exists() else None)
            check_out(self.out, kind="run", inputs=inputs, force=self.force, file=True)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# run configuration key -> (RunConfig field, the `moeflow run` parameters that set it)
CONFIG_FIELDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "capacity": ("capacities", ("capacity", "cache_capacity")),
    "eviction": ("evictions", ("eviction",)),
    "prefetch": ("prefetches", ("prefetch",)),
    "lookahead": ("lookahead", ("lookahead",)),
    "adaptive_s": ("adaptive_s", ("adaptive_s",)),
    "miss": ("miss", ("miss",)),
    "link": ("link", ("link",)),
    "calibration": ("calibration", ("calibration",)),
}


OFFLOAD_FLAGS = {  # `moeflow run`'s parameters that only an offload run reads (its cache and policies) -> their flag
    "capacity": "--capacity",
    "cache_capacity": "--capacity",
    "per_layer_cache": "--per-layer-cache",
    "eviction": "--eviction",
    "eviction_opt": "--eviction-opt",
    "prefetch": "--prefetch",
    "prefetch_opt": "--prefetch-opt",
    "lookahead": "--lookahead",
    "adaptive_s": "--adaptive-s",
    "miss": "--miss",  # on-demand fetches every miss, resident has none
    "miss_opt": "--miss-opt",
    "routing": "--routing",  # both route as the model does
    "routing_opt": "--routing-opt",
    "prefill": "--prefill",
}


def check_offload_flags(modes: tuple[str, ...], given: set[str]) -> None:
    """A cache or policy flag typed on the command line (`given`: parameter names) for runs that have no cache
    (--mode resident / on-demand only) is one line, not silently ignored. An unknown mode is left to
    `RunConfig`'s own line."""
    if "offload" in modes or not set(modes) <= set(MODES):
        return
    flags = sorted({OFFLOAD_FLAGS[p] for p in given if p in OFFLOAD_FLAGS})
    if flags:
        one = len(flags) == 1
        raise ConfigError(
            f"{', '.join(flags)} appl{'ies' if one else 'y'} to --mode offload only, and --mode {','.join(modes)} "
            f"runs none; drop {'it' if one else 'them'}, or add offload to --mode (with --sweep)"
        )


def apply_config_file(path: str, kw: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """`kw` (RunConfig keyword arguments from the flags) with the run configuration file at `path` applied
    (`moeflow.tune.config`): each of its options, and its model, unless one of the `moeflow run` parameters that
    set it is in `given` (the flags on the command line win). Records the file and its model's fingerprint."""
    from ..tune.config import read_run_config

    rec = read_run_config(path)
    out = dict(kw)
    for key, (fld, params) in CONFIG_FIELDS.items():
        if given.intersection(params):
            continue
        v = rec["options"][key]
        if v is None and fld not in ("lookahead", "calibration"):  # null: the flag's default
            continue
        if fld in ("capacities", "evictions", "prefetches"):
            v = (str(v),)
        elif fld == "lookahead" and v is not None:
            v = int(v)
        out[fld] = v
    if "model" not in given and rec.get("model"):
        out["model"] = str(rec["model"])
    out["config"] = str(path)
    out["config_fingerprint"] = str(rec["model_fingerprint"])
    out["config_keys"] = applied_keys(rec["options"], given)
    return out


# run configuration key -> the words a refusal of its value starts from (the flag it stands for)
_CONFIG_WORDS = {
    "capacity": ("--capacity",),
    "eviction": ("eviction policy", "--eviction"),
    "prefetch": ("prefetch policy", "--prefetch"),
    "lookahead": ("-S ", "--lookahead"),
    "miss": ("miss policy", "--miss"),
    "link": ("--link", "link"),
    "calibration": ("calibration",),
}


def applied_keys(opts: dict[str, Any], given: set[str]) -> tuple[str, ...]:
    """The run configuration keys whose value (not null) a --config file's `opts` sets when the `moeflow run`
    parameters in `given` were typed."""
    return tuple(k for k, (_, params) in CONFIG_FIELDS.items() if opts[k] is not None and not given.intersection(params))


@contextmanager
def naming_config_file(path: str | None, keys: tuple[str, ...]) -> Iterator[None]:
    """A refusal of a value the --config file at `path` set (`keys`, `applied_keys`) says so: the message names
    the flag the value stands for, and the user typed none of them."""
    try:
        yield
    except ConfigError as e:
        msg = str(e)
        hit = next((k for k in keys if any(w in msg for w in _CONFIG_WORDS[k])), None) if path else None
        if hit is None:
            raise
        raise ConfigError(f"{msg} (the {hit!r} of --config {path})") from e


def check_config_model(cfg: RunConfig, model: Any) -> None:
    """Refuse running a --config file tuned for another model (one line naming it)."""
    if cfg.config_fingerprint is None:
        return
    from ..moe import model_fingerprint

    fp = model_fingerprint(model)
    if fp != cfg.config_fingerprint:
        from ..artifacts import another_model
        from ..errors import ArtifactError
        from ..tune.config import read_run_config

        try:
            meta = read_run_config(str(cfg.config))  # names the model it was tuned for
        except ArtifactError:
            meta = {"model_fingerprint": cfg.config_fingerprint}
        raise another_model(f"run configuration {cfg.config}", meta, fp, "re-run `moeflow tune` with this --model")


FIT_SHARE = 0.9  # `--load-experts auto` loads the whole checkpoint on the device up to this share of its free memory


def experts_placement(
    requested: str, device_type: str, weights: int | None, free: int | None, resident: bool, command: str = "moeflow run"
) -> tuple[str, str]:
    """Where the routed experts load, and why: "device" (the whole model on the device; an engine then moves the
    experts to host memory and back when it closes) or "host" (they never reach the device: a model whose experts
    do not fit there). On a CPU device both are host memory: "device". `auto`: "host" when the checkpoint's
    `weights` bytes exceed `FIT_SHARE` of the device's `free` bytes. A resident run needs "device": refused
    (ConfigError) where the experts must stay on the host."""
    what = "--mode resident" if command == "moeflow run" else f"`{command}`'s stock-model reference"  # a resident run
    if device_type == "cpu":
        return "device", ""
    if requested == "device":
        return "device", "--load-experts device"
    if requested == "host":
        if resident:
            raise ConfigError(f"{what} runs the stock model with every expert on the device: not with --load-experts host")
        return "host", "--load-experts host"
    if weights is None or free is None or weights <= FIT_SHARE * free:
        return "device", ""
    gib = 1 << 30
    why = f"the checkpoint's {weights / gib:.1f} GiB exceed {FIT_SHARE:.0%} of the {free / gib:.1f} GiB free on the device"
    if resident:
        raise ConfigError(f"{why}: {what} needs every expert there; drop it, or use a device with more free memory")
    return "host", why


def _proposes(prefetch: str) -> bool:
    """Whether prefetch policy `prefetch` (`name[:k=v,...]`) ever proposes a copy (not `none`)."""
    from ..policies import PREFETCH

    name = policy_args(prefetch)[0]
    return name in PREFETCH and PREFETCH[name].proposes


def _speculates(prefetch: str) -> bool:
    """Whether prefetch policy `prefetch` (`name[:k=v,...]`) declares that its predictor can route (`--speculative`)."""
    from ..policies import PREFETCH

    name = policy_args(prefetch)[0]
    return name in PREFETCH and PREFETCH[name].speculates
