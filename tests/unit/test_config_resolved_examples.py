"""Every recipe in examples/ (and a few verl-named overrides) resolves to the values recorded before
the config restructuring (fixtures/example_configs_resolved.json, written by the code of commit
3e087e5): options moved into registered dataclasses keep their keys, defaults and spellings.
Changed since on purpose (issue 19): `algorithm.daa` gained `amplification` and `history_decay`, and
its defaults and the DA3PO recipes became the paper's rule (`factor: constant`, `difficulty: group`);
`trainer.max_generated_tokens` and `eval.token_interval` (default 0) are new; `rollout.vllm_python` and
`rollout.vllm_extra_args` are new (issue 18); `trainer.max_staleness` (default 0),
`algorithm.rollout_correction.*` (mode auto: no correction unless actor.tis or trainer.max_staleness
asks) and `actor.old_logprob_source` (recompute) are new (issue 16), and so are `rollout.pause_mode` and `rollout.partial_rollout`; `rollout.colocate` (false) is new
(issue 17), and `examples/qwen2.5-7b/dapo-colocate.yaml` was added then (recorded with `_resolved`).
Added since: `examples/qwen2.5-32b/dapo-vllm.yaml` (issue 18), recorded with `_resolved` below; it
must stay dapo.yaml with vLLM engines (`test_dapo_vllm_is_dapo_with_vllm_engines`). Added since:
`examples/qwen2.5-32b/dapo-async.yaml` (issue 16, eta = 1), recorded with `_resolved`; it must stay
dapo.yaml with `trainer.max_staleness: 1` and partial rollouts (`test_dapo_async_is_dapo_with_eta_1`). Changed since (issue 16's measurement): the
tiny recipes set `rollout.pause_mode: in_place` (it acts only with `trainer.max_staleness` > 0).
Changed since (issue 22): `actor.sequence_packing` (false) is new, and examples/tiny/grpo.yaml sets it,
`actor.old_logprob_source: rollout`, `rollout.num_servers: 2` and `trainer.nproc_per_node: 2` (the TRL
comparison's recipe); `trainer.attention_backend` (auto) is new, and grpo.yaml sets it to sdpa with
`trainer.transformer_impl: local` and `weight_sync.load_format: flattened_bucket`. New since (issue 29,
Mixture-of-Experts): `actor.router_replay` (false), `trainer.expert_model_parallel_size` (1),
`trainer.expert_tensor_parallel_size` (None = TP), `trainer.moe_router_load_balancing_type` (none),
`trainer.moe_aux_loss_coeff` (0.0), `rollout.return_routed_experts` (None = with replay). Added since (issue 29): `examples/qwen3-30b-a3b/dapo.yaml`, recorded with
`_resolved`; it must stay the 32B dapo.yaml on the MoE model (`test_moe_dapo_is_dapo_on_qwen3_30b_a3b`).
And `examples/tiny/moe-dapo.yaml`, recorded with `_resolved`; it must stay the tiny dapo.yaml on the
tiny MoE model with replay (`test_tiny_moe_dapo_is_dapo_on_the_moe_model_with_replay`). New since (issue 32):
`rollout.check_logprob_semantics` (true: the engines' log-probs are checked before step 1). New since
(issue 31): the `rollout.multi_turn` section (off by default). New since (issue 30):
`rollout.parallel_sampling` (None = on for the vLLM backends)."""

import json
from pathlib import Path

import pytest

from megatron_rl.config import config_to_dict, load_config

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "example_configs_resolved.json").read_text())


def _resolved(recipe: str, overrides: list[str]) -> dict:
    d = config_to_dict(load_config(ROOT / recipe, overrides))
    return json.loads(json.dumps(d).replace(str(ROOT), "$ROOT"))


@pytest.mark.parametrize("case", sorted(FIXTURE))
def test_recipe_resolves_to_the_recorded_values(case):
    recipe, *overrides = case.split(" ")
    assert _resolved(recipe, overrides) == FIXTURE[case]


def test_every_example_recipe_is_recorded():
    recipes = {str(p.relative_to(ROOT)) for d in ("tiny", "qwen2.5-32b", "qwen2.5-7b", "qwen3-30b-a3b") for p in (ROOT / "examples" / d).glob("*.yaml")}
    assert recipes <= set(FIXTURE)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_dapo_vllm_is_dapo_with_vllm_engines():
    """The loader has no recipe inheritance, so dapo-vllm.yaml is a full copy of dapo.yaml: it may
    differ only in the rollout engine's keys and the pipeline split vLLM's weight transfer needs."""
    sglang = _flat(_resolved("examples/qwen2.5-32b/dapo.yaml", []))
    vllm = _flat(_resolved("examples/qwen2.5-32b/dapo-vllm.yaml", []))
    assert {k for k in sglang if sglang[k] != vllm[k]} == {
        "run_dir", "rollout.backend", "rollout.vllm_extra_args", "rollout.tp_size", "rollout.mem_fraction_static",
        "trainer.pipeline_model_parallel_size"}
    assert vllm["rollout.backend"] == "vllm" and vllm["trainer.pipeline_model_parallel_size"] == 1


def test_dapo_async_is_dapo_with_eta_1():
    """dapo-async.yaml is a full copy of dapo.yaml (no recipe inheritance): it may differ only in
    eta = 1 (`trainer.max_staleness`), the resubmission of updated requests with their prefix
    (`rollout.partial_rollout`) and its run_dir; the correction stays `auto` (-> token_tis at eta 1)."""
    sync = _flat(_resolved("examples/qwen2.5-32b/dapo.yaml", []))
    async_ = _flat(_resolved("examples/qwen2.5-32b/dapo-async.yaml", []))
    assert set(sync) == set(async_)
    assert {k for k in sync if sync[k] != async_[k]} == {"run_dir", "trainer.max_staleness", "rollout.partial_rollout"}
    assert async_["trainer.max_staleness"] == 1 and async_["rollout.partial_rollout"] is True
    assert async_["rollout.pause_mode"] == "abort"
    assert async_["algorithm.rollout_correction.mode"] == "auto" and async_["actor.old_logprob_source"] == "recompute"


def test_moe_dapo_is_dapo_on_qwen3_30b_a3b():
    """examples/qwen3-30b-a3b/dapo.yaml is a full copy of the 32B dapo.yaml (no recipe inheritance): it may
    differ only in the model (its config.json), the MoE layout (TP 4, PP 1, EP 2), the engines' TP and
    rollout routing replay (issue 29)."""
    dense = _flat(_resolved("examples/qwen2.5-32b/dapo.yaml", []))
    moe = _flat(_resolved("examples/qwen3-30b-a3b/dapo.yaml", []))
    assert set(dense) == set(moe)
    assert {k for k in dense if dense[k] != moe[k]} == {
        "run_dir", "model.hf_config_path", "rollout.tp_size", "actor.router_replay",
        "trainer.tensor_model_parallel_size", "trainer.pipeline_model_parallel_size",
        "trainer.expert_model_parallel_size"}
    assert moe["actor.router_replay"] is True and moe["trainer.expert_model_parallel_size"] == 2
    assert moe["trainer.expert_tensor_parallel_size"] is None and moe["trainer.sequence_parallel"] is True


def test_tiny_moe_dapo_is_dapo_on_the_moe_model_with_replay():
    """examples/tiny/moe-dapo.yaml (issue 29) is a full copy of examples/tiny/dapo.yaml: it may
    differ only in the model (the tiny Qwen3-MoE), routing replay and its run_dir."""
    dense = _flat(_resolved("examples/tiny/dapo.yaml", []))
    moe = _flat(_resolved("examples/tiny/moe-dapo.yaml", []))
    assert {k for k in dense if dense[k] != moe[k]} == {"run_dir", "model.path", "actor.router_replay"}
    assert moe["actor.router_replay"] is True and moe["model.path"].endswith("examples/tiny/moe_base_model")


def test_tool_dapo_7b_is_dapo_colocate_with_tools():
    """examples/qwen2.5-7b/tool-dapo.yaml (issue 31) is dapo-colocate.yaml with multi-turn tool
    episodes; SGLang keeps its tokenizer to match the code format's stop string."""
    base = _flat(_resolved("examples/qwen2.5-7b/dapo-colocate.yaml", []))
    tool = _flat(_resolved("examples/qwen2.5-7b/tool-dapo.yaml", []))
    assert {k for k in base if base[k] != tool[k]} == {
        "run_dir", "rollout.skip_tokenizer_init", "rollout.multi_turn.enable", "rollout.multi_turn.max_assistant_turns",
        "rollout.multi_turn.max_tool_calls", "rollout.multi_turn.max_tool_response_length",
        "rollout.multi_turn.tool_config_path"}
    assert tool["rollout.multi_turn.tool_config_path"] == "$ROOT/examples/tools/python_tool_cluster.yaml"


def test_tiny_tool_dapo_is_dapo_with_tools():
    """examples/tiny/tool-dapo.yaml (issue 31) is the tiny dapo.yaml on the tool base model with
    multi-turn tool episodes and room for the tool's tokens in the response budget."""
    base = _flat(_resolved("examples/tiny/dapo.yaml", []))
    tool = _flat(_resolved("examples/tiny/tool-dapo.yaml", []))
    assert {k for k in base if base[k] != tool[k]} == {
        "run_dir", "model.path", "data.max_response_length", "rollout.multi_turn.enable",
        "rollout.multi_turn.max_assistant_turns", "rollout.multi_turn.max_tool_calls",
        "rollout.multi_turn.tool_config_path"}
    assert tool["model.path"] == "$ROOT/examples/tiny/tool_base_model"
