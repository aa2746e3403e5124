"""Every recipe in examples/ (and a few verl-named overrides) resolves to the values recorded before
the config restructuring (fixtures/example_configs_resolved.json, written by the code of commit
3e087e5): options moved into registered dataclasses keep their keys, defaults and spellings.
Changed since on purpose (issue 19): `algorithm.daa` gained `amplification` and `history_decay`, and
its defaults and the DA3PO recipes became the paper's rule (`factor: constant`, `difficulty: group`);
`trainer.max_generated_tokens` (default 0) is new; `rollout.vllm_python` and `rollout.vllm_extra_args`
are new (issue 18); `rollout.pause_mode` and `rollout.partial_rollout` are new (issue 16)."""

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
    recipes = {str(p.relative_to(ROOT)) for d in ("tiny", "qwen2.5-32b") for p in (ROOT / "examples" / d).glob("*.yaml")}
    assert recipes <= set(FIXTURE)
