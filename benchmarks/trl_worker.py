"""TRL side of `benchmarks/trl_compare.py`: GRPO on the tiny task with TRL's GRPOTrainer.

Runs inside the benchmark's own virtual environment (`benchmarks/.trl-venv`, made by
trl_compare.py) with TRL, the same torch and transformers versions as the project, and the
project's source on `sys.path` only for the DAPO verifier (`megatron_rl.rewards.math_dapo`, pure
Python). Not meant to be run by hand:

    benchmarks/.trl-venv/bin/python benchmarks/trl_worker.py SPEC.json

SPEC.json (written by trl_compare.py, `trl_settings`) holds the settings, derived from
`examples/tiny/grpo.yaml`:

| megatron-rl (grpo.yaml)                         | TRL GRPOConfig                                          |
|-------------------------------------------------|---------------------------------------------------------|
| data.train_batch_size 16 x rollout.n 8          | per_device_train_batch_size 64 x steps_per_generation 2 |
| actor.ppo_mini_batch_size 8 (2 updates a step)  | steps_per_generation 2 (one generation, 2 updates)      |
| actor.ppo_micro_batch_size 64                   | per_device_train_batch_size 64, no accumulation         |
| loss_agg_mode seq-mean-token-mean               | loss_type "grpo"                                        |
| clip_ratio_low / high 0.2 / 0.2                 | epsilon 0.2, epsilon_high 0.2                           |
| adv_estimator grpo (std-normalised)             | scale_rewards "group"                                   |
| no KL loss                                      | beta 0.0                                                |
| optim lr 1e-4, warm-up 2 RL steps, wd 0, clip 1 | learning_rate 1e-4, warmup_steps 4 (updates), constant  |
| max_response_length 64, temperature 1, top_p 1  | max_completion_length 64, temperature 1, top_p 1, top_k 0 |
| reward_fn dapo_math (+1 / -1)                   | the same function, imported from megatron_rl            |
| trainer.recompute None, fp32 on CPU             | gradient_checkpointing False (TRL defaults to True), fp32 |

Training stops at an RL-step boundary (every `steps_per_generation` optimizer steps) once the
summed step time reaches the wall budget (`budget_s`; the step whose midpoint crosses the budget
is the last), or after `max_rl_steps`. Writes `result.json` in `out_dir` (per-RL-step seconds,
completion tokens, rewards) and the final weights as a Hugging Face folder in `out_dir/final`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    sys.path.insert(0, spec["repo"])  # for megatron_rl.rewards.math_dapo (pure Python)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_rl.rewards.math_dapo import compute_score

    torch.manual_seed(spec["seed"])
    out_dir = Path(spec["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in Path(spec["train_file"]).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": str(r["reward_model"]["ground_truth"])}
                                 for r in rows])

    tally = {"completion_tokens": 0, "completions": 0, "correct": 0}

    def dapo_reward(completions, ground_truth, completion_ids=None, **_):
        """DAPO rule (+1 / -1) on the response text, as megatron-rl's `dapo_math`."""
        scores = []
        for i, (c, gt) in enumerate(zip(completions, ground_truth)):
            text = c[0]["content"] if isinstance(c, list) else c
            out = compute_score(text, gt)
            scores.append(float(out["score"]))
            tally["correct"] += bool(out["acc"])
            tally["completions"] += 1
            tally["completion_tokens"] += len(completion_ids[i]) if completion_ids is not None else 0
        return scores

    g = spec["grpo"]
    steps_per_gen = g["steps_per_generation"]
    cfg = GRPOConfig(
        output_dir=str(out_dir / "trainer"), use_cpu=True, bf16=False, fp16=False, seed=spec["seed"],
        per_device_train_batch_size=g["per_device_train_batch_size"], gradient_accumulation_steps=1,
        steps_per_generation=steps_per_gen, num_generations=g["num_generations"],
        max_completion_length=g["max_completion_length"], temperature=g["temperature"], top_p=g["top_p"], top_k=0,
        learning_rate=g["learning_rate"], lr_scheduler_type="constant_with_warmup", warmup_steps=g["warmup_steps"],
        weight_decay=g["weight_decay"], max_grad_norm=g["max_grad_norm"], adam_beta1=g.get("adam_beta1", 0.9),
        adam_beta2=g.get("adam_beta2", 0.999), adam_epsilon=g.get("adam_epsilon", 1e-8), beta=0.0, epsilon=g["epsilon"], epsilon_high=g["epsilon_high"], loss_type="grpo",
        scale_rewards="group", num_iterations=1, mask_truncated_completions=False, disable_dropout=True,
        max_steps=spec["max_rl_steps"] * steps_per_gen, logging_steps=1, save_strategy="no", report_to="none",
        dataloader_num_workers=0, log_completions=False, model_init_kwargs={"dtype": torch.float32},
        gradient_checkpointing=False,  # TRL's default is True; megatron-rl's tiny recipes do not recompute
    )

    class Clock(TrainerCallback):
        """Per-optimizer-step wall time; stops at an RL-step boundary once the budget is spent."""

        def __init__(self) -> None:
            self.t_begin = 0.0
            self.opt_steps: list[float] = []
            self.rl_steps: list[dict] = []
            self.logs: list[dict] = []
            self._tokens_before = 0
            self._completions_before = 0
            self._correct_before = 0
            self._rl_s = 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.t_begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            dt = time.perf_counter() - self.t_begin
            self.opt_steps.append(dt)
            self._rl_s += dt
            if state.global_step % steps_per_gen:
                return
            self.rl_steps.append({
                "step_s": self._rl_s,
                "completion_tokens": tally["completion_tokens"] - self._tokens_before,
                "completions": tally["completions"] - self._completions_before,
                "acc": (tally["correct"] - self._correct_before) / max(tally["completions"] - self._completions_before, 1),
            })
            self._tokens_before, self._completions_before = tally["completion_tokens"], tally["completions"]
            self._correct_before = tally["correct"]
            self._rl_s = 0.0
            spent = sum(s["step_s"] for s in self.rl_steps)
            last = self.rl_steps[-1]["step_s"]
            if spec["budget_s"] and spent + 0.5 * last >= spec["budget_s"]:
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kw):
            if logs:
                self.logs.append({"step": state.global_step, **{k: v for k, v in logs.items()
                                                                 if isinstance(v, (int, float))}})

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=dapo_reward, args=cfg, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock])
    t_ready = time.perf_counter()
    trainer.train()
    t_trained = time.perf_counter()
    final = out_dir / "final"
    trainer.save_model(str(final))
    tokenizer.save_pretrained(str(final))
    import trl
    import transformers

    result = {
        "versions": {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "torch_threads": torch.get_num_threads(),
        "setup_s": t_ready - t0, "train_wall_s": t_trained - t_ready,
        "rl_steps": clock.rl_steps, "optimizer_step_s": clock.opt_steps, "logs": clock.logs,
        "final_model": str(final), "budget_s": spec["budget_s"],
    }
    (out_dir / "result.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: trl_worker.py SPEC.json (written by benchmarks/trl_compare.py)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1])
