"""`moeflow ep`: expert-parallel execution over torch.distributed (gloo on CPU) is token-identical to one process."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from moeflow.lmtrain.tokenizer import train_tokenizer
    from moeflow.models import tiny_model

    d = tmp_path_factory.mktemp("epckpt")
    text = ["the king said to the queen that the night was long", "to be or not to be, that is the question"] * 20
    tok = train_tokenizer(text, vocab_size=200)
    tiny_model("olmoe", num_experts=8, top_k=2).save_pretrained(d)
    tok.save_pretrained(d)
    # expert 0 on both ranks, expert 7 on both ranks (rank 0 preferred), the rest contiguous
    dup = {"*": {str(e): ([0, 1] if e == 0 else [0, 1] if e == 7 else [e * 2 // 8]) for e in range(8)}}
    (d.parent / "dup.json").write_text(json.dumps(dup))
    return d


def _cfg(ckpt, **kw):
    from moeflow.stages.ep import EPConfig
    from moeflow.stages.run_config import RunConfig

    run_kw = dict(
        model=str(ckpt),
        prompt=("the king said", "to be or not to be that"),
        max_new_tokens=6,
        min_new_tokens=6,
        modes=("resident",),
        threads=1,
        batch_size=kw.pop("batch_size", 1),
    )
    return EPConfig(run=RunConfig(**run_kw), **kw)


def _cli(args):
    from moeflow.cli.app import main

    try:
        main(args)
    except SystemExit as e:
        return e.code
    return 0


def test_world_size_2_gloo_identical_with_duplicated_expert(ckpt):
    """One spawn of two gloo ranks runs both placements: tokens equal one process, both ranks compute rows."""
    from moeflow.stages.ep import launch

    res = launch(_cfg(ckpt, world_size=2, placements=("contiguous", str(ckpt.parent / "dup.json")), timeout_s=120))
    assert res is not None and res["world_size"] == 2 and res["backend"] == "gloo"
    assert res["identical_to_single_process"] is True
    assert len(res["runs"]) == 2
    for run in res["runs"]:
        assert run["identical_to_single_process"] is True and run["ranks_agree"]
        assert [o["token_ids"] for o in run["outputs"]] == res["reference_token_ids"]
        assert all(len(o["token_ids"]) == 6 for o in run["outputs"])
        assert len(run["rows_by_rank"]) == 2 and min(run["rows_by_rank"]) > 0  # both ranks computed rows
        for L in run["layers"]:
            assert L["calls"] > 0 and sum(L["rows_by_rank"]) > 0
            assert all(L[f"{ph}_s"] >= 0 for ph in ("dispatch", "compute", "combine", "gather"))
            assert L["busiest_rows"] == max(L["rows_by_rank"])
    contiguous, dup = res["runs"]
    assert contiguous["duplicated_experts"] == 0 and dup["duplicated_experts"] == 2 * len(dup["layers"])  # 2 per layer
    assert contiguous["layers"][0]["held_by_rank"] == [4, 4]
    assert dup["layers"][0]["held_by_rank"] == [5, 5]
    # every (token, expert) row is computed exactly once, whatever the placement
    assert sum(contiguous["rows_by_rank"]) == sum(dup["rows_by_rank"])


def test_world_size_1_bitwise_logits_across_archs(tiny_models, tmp_path):
    """In-process single-rank group: the `moeflow-ep` forward gives the stock grouped_mm logits bit for bit."""
    import copy

    import torch.distributed as dist

    from moeflow.ep import ExpertParallel, default_placement
    from moeflow.moe import get_adapter

    # a FileStore in tmp_path (torch removes the file when the group is destroyed)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for arch in ("olmoe", "mixtral", "qwen2_moe", "gpt_oss"):
            model = copy.deepcopy(tiny_models(arch))
            model.set_experts_implementation("grouped_mm")
            ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                ref = model(ids).logits
            spec = get_adapter(model).spec
            with ExpertParallel(model, default_placement(spec.moe_layers, spec.num_experts, 1)) as ep:
                with torch.no_grad():
                    got = model(ids).logits
                assert sum(s.calls for s in ep.stats.values()) == spec.num_moe_layers
            assert torch.equal(ref, got), arch
    finally:
        dist.destroy_process_group()


def test_assign_least_loaded_replica_is_deterministic():
    from moeflow.ep.placement import parse_placement

    p = parse_placement({"0": {"0": [0, 1], "1": [0], "2": [1], "3": [1, 0]}}, [0], 4, 2)
    # fixed load: rank 0 has 5 (expert 1), rank 1 has 1 (expert 2); expert 0 (9 rows) -> rank 1, expert 3 -> rank 0
    assert p.assign(0, [9, 5, 1, 3]) == [1, 0, 1, 0]
    assert p.assign(0, [9, 5, 1, 3]) == p.assign(0, [9, 5, 1, 3])
    assert p.assign(0, [0, 0, 0, 0]) == [0, 0, 1, 1]  # ties: the first listed replica
    assert p.duplicated() == 2 and p.experts_of(0, 0) == [0, 1, 3]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--world-size", "0"], "--world-size must be >= 1"),
        (["--world-size", "9"], "exceeds the model's 8 experts"),
        (["--placement", "missing.json"], "does not exist"),
        (["--placement", "{bad}"], "placement file"),
        (["--placement", "RANK3"], "outside world size 2"),
        (["--placement", "HOLE"], "places no rank for expert(s) [5]"),
        (["--placement", "LAYER9"], "layer 9 is not an MoE layer"),
        (["--backend", "mpi"], "--backend 'mpi' unknown"),
    ],
)
def test_bad_world_size_or_placement_is_one_line(ckpt, tmp_path, capsys, args, words):
    files = {
        "RANK3": {"*": {str(e): [3 if e == 0 else 0] for e in range(8)}},
        "HOLE": {"0": {str(e): [0] for e in range(8) if e != 5}},
        "LAYER9": {"9": {"0": [0]}},
    }
    args = list(args)
    if "--placement" in args:
        i = args.index("--placement") + 1
        name = args[i]
        if name in files:
            (tmp_path / f"{name}.json").write_text(json.dumps(files[name]))
            args[i] = str(tmp_path / f"{name}.json")
        elif name == "{bad}":
            (tmp_path / "bad.json").write_text("{not json")
            args[i] = str(tmp_path / "bad.json")
        else:
            args[i] = str(tmp_path / name)
    code = _cli(["ep", "-m", str(ckpt), "--prompt", "the king", "--max-new-tokens", "2", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and words in err, err
