"""The predictor folder: meta.json + one sub-folder per predictor, written atomically.

    <out>/meta.json        kind "predictors", schema, model_fingerprint, trace (path, fingerprint,
                           trained_prompt_ids: the prompts fitted on; absent in older folders),
                           predictors (names), config (TrainConfig), eval (the held-out report)
    <out>/<name>/...       what each predictor's `save` writes
    <out>/recall.png       per-layer recall and recall-vs-S plot

Loading checks the kind, the schema and the model fingerprint; a folder made for another model
is refused with one line. Nothing in a predictor folder is unpickled: tensors are read with
`torch.load(weights_only=True)`, arrays with `np.load(allow_pickle=False)`, the rest is JSON; a file
that cannot be read that way is refused with one line naming it (`artifact_file`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..artifacts import another_model, atomic_dir, check_fingerprint, made_with, new_meta, read_meta, write_json_atomic
from ..errors import ArtifactError, MoeflowError, brief
from ..moe import model_fingerprint
from .base import PREDICTORS

KIND = "predictors"
SCHEMA = 1


@contextlib.contextmanager
def artifact_file(path: Path) -> Iterator[None]:
    """Turn any failure to read or check `path` (a file of a predictor folder) into one ArtifactError line."""
    try:
        yield
    except MoeflowError:
        raise
    except Exception as e:
        why = "it is missing" if isinstance(e, FileNotFoundError) else f"it is corrupt: {type(e).__name__}: {brief(str(e))}"
        raise ArtifactError(f"cannot load {path} ({why}); re-run `moeflow train`") from e


def read_json_file(path: Path) -> dict[str, Any]:
    """A JSON object from a predictor folder (see `artifact_file`)."""
    with artifact_file(path):
        obj = json.loads(path.read_text())
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        return obj


def read_config(folder: Path, holds: str, version: int) -> dict[str, Any]:
    """`folder/config.json` of a learned predictor (see `read_json_file`), refused with one line unless its input
    features are `version` ("features", 1 when absent); `holds` names them: "a forest with features"."""
    c = read_json_file(folder / "config.json")
    if int(c.get("features", 1)) != version:
        raise ArtifactError(
            f"{folder} holds {holds} v{c.get('features', 1)}; this moeflow needs v{version}: re-run `moeflow train`"
        )
    return c


def read_plan_meta(folder: Path, kind: str, schema: int, fingerprint: str | None) -> dict[str, Any]:
    """`<kind>.json` of a CasMoE plan artifact (`eam`, `eap`) in `folder`: refuses another kind or schema and,
    given `fingerprint`, another model's folder."""
    name = kind.upper()
    meta = read_json_file(folder / f"{kind}.json")
    if meta.get("kind") != kind or meta.get("schema") != schema:
        raise ArtifactError(f"{folder}/{kind}.json is not an {name} of schema {schema}; re-run `moeflow train --only {kind}`")
    if fingerprint is not None and meta.get("model_fingerprint") != fingerprint:
        try:  # the predictor folder's meta.json records the model
            parent = json.loads((folder.parent / "meta.json").read_text())
        except (OSError, ValueError):
            parent = {}
        made = {**meta, "model": meta.get("model") or (made_with(parent) if isinstance(parent, dict) else None)}
        raise another_model(f"{name} at {folder}", made, fingerprint, f"re-run `moeflow train --only {kind}` with this --model")
    return meta


def load_tensors(path: Path) -> Any:
    """`torch.load(path, weights_only=True)`: tensors and plain containers only, never code (see `artifact_file`)."""
    with artifact_file(path):
        return torch.load(path, map_location="cpu", weights_only=True)


def save_predictors(
    out: str | Path,
    predictors: Mapping[str, Any],
    model: torch.nn.Module,
    *,
    trace: str,
    trace_fingerprint: str | None,
    config: dict[str, Any],
    report: dict[str, Any] | None,
    plot_fn: Any = None,
    extra: Mapping[str, Any] | None = None,
    trained_prompt_ids: list[str] | None = None,
) -> Path:
    """`extra`: sub-folder name -> a function writing it (the CasMoE planner's `eam/`, `eap/`), listed in
    meta.json under `extra`. `trained_prompt_ids`: the trace's prompt ids (content hashes) the predictors were
    fitted on, kept under `trace` so `moeflow eval` can tell whether its prompts are held out."""
    out = Path(out)
    with atomic_dir(out) as tmp:
        for name, p in predictors.items():
            sub = tmp / name
            sub.mkdir()
            p.save(sub)
        for name, write in (extra or {}).items():
            write(tmp / name)
        if report is not None and plot_fn is not None:
            plot_fn(report, tmp / "recall.png")
        meta = new_meta(
            KIND,
            SCHEMA,
            model_fingerprint(model),
            trace={
                "path": str(trace),
                "fingerprint": trace_fingerprint,
                **({"trained_prompt_ids": list(trained_prompt_ids)} if trained_prompt_ids is not None else {}),
            },
            predictors=list(predictors),
            extra=list(extra or {}),
            config=config,
            eval=report,
        )
        write_json_atomic(tmp / "meta.json", meta)
    return out


def read_predictor_meta(folder: str | Path) -> dict[str, Any]:
    """The predictor folder's checked meta.json (`read_meta` names `moeflow train` in its hints)."""
    return read_meta(folder, KIND, SCHEMA)


def load_predictors(
    folder: str | Path, model: torch.nn.Module, names: list[str] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, name -> predictor) for `model`; refuses a folder made for another model."""
    folder = Path(folder)
    meta = read_predictor_meta(folder)
    check_fingerprint(meta, model_fingerprint(model), "predictor folder", folder)
    have = meta.get("predictors", [])
    names = have if names is None else names
    missing = [n for n in names if n not in have]
    if missing:
        raise ArtifactError(
            f"{folder} has no {', '.join(missing)} predictor (it has {', '.join(have)}); "
            f"re-run `moeflow train --only {' '.join(missing)}`"
        )
    out = {}
    for n in names:
        if n not in PREDICTORS:
            raise ArtifactError(f"{folder} holds predictor {n!r} that this moeflow does not know")
        with artifact_file(folder / n):
            out[n] = PREDICTORS[n].load(folder / n, model)
    return meta, out
