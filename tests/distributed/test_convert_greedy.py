"""A policy trained a few steps, exported to HF, generates in transformers the same greedy tokens as
the rollout server did with the weights the trainer synced to it (issue 4, "Done when").

Real parts: megatron-core PolicyTrainer on one gloo rank, the embedded rollout server in its own
process, the broadcast weight sync of the training loop (`iter_hf_weights` -> `WeightSyncSender`),
a run checkpoint written by `save_checkpoint`, and the streaming `export_to_hf`.
"""

import pytest
import torch

from megatron_rl.checkpoint.convert import export_to_hf
from megatron_rl.checkpoint.save import save_checkpoint
from tests.distributed.test_checkpoint import _step, _trainer
from tests.distributed.tiny_qwen2 import tiny_hf_config, tiny_hf_model

pytestmark = pytest.mark.timeout(400)

PROMPTS = [[5, 6, 7], [11, 3, 90, 17, 4], [100], [42, 42]]
NEW_TOKENS = 12


def _hf_greedy(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def test_exported_policy_generates_the_servers_greedy_tokens(megatron_world1, tmp_path):
    from megatron_rl.models.hf_weights import iter_hf_weights
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.rollout.launcher import launch_rollout_server
    from megatron_rl.weight_sync.sender import WeightSyncSender

    hf_config = tiny_hf_config(tie_word_embeddings=False)  # no EOS: every answer has NEW_TOKENS tokens
    base = tmp_path / "base"
    tiny_hf_model(hf_config, seed=0).save_pretrained(base)
    trainer = _trainer(hf_config)  # the same base weights in megatron-core
    for seed in (1, 2, 3):
        _step(trainer, seed=seed)
    run_dir = tmp_path / "run"
    save_checkpoint(run_dir, 3, model=trainer.model, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
                    run_state={}, config_yaml=f"model:\n  path: {base}\n", keep_last_n=2)

    extra = ["--dtype", "float32", "--weight-version", "0", "--weight-sync-timeout-s", "120"]
    with launch_rollout_server(base, log_path=tmp_path / "server.log", extra_args=extra) as server:
        client = RolloutClient(server.base_url, timeout_s=60, generate_timeout_s=60)

        def server_greedy():
            return [client.generate(p, {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS,
                                        "temperature": 0}, rid=f"g{i}").output_ids for i, p in enumerate(PROMPTS)]

        before = server_greedy()
        sender = WeightSyncSender([client], timeout_s=60)
        sender.init_group()
        try:
            sender.sync(iter_hf_weights(trainer.model[0], hf_config), weight_version="3")
        finally:
            sender.close()
        assert client.weight_version() == "3"
        served = server_greedy()

    exported = export_to_hf(run_dir, tmp_path / "exported")
    assert _hf_greedy(exported) == served
    assert served != before  # training changed the greedy answers, so the equality is informative
    assert _hf_greedy(base) == before
