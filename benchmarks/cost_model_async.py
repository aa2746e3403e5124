"""The asynchronous step (issue 16) of the cost model: Qwen2.5-32B DAPO with `trainer.max_staleness` 1, disaggregated.

Part of `benchmarks/cost_model.py` (its `main` prints this section and stores it under `"async"` in
`benchmarks/results/cost_model.json`); kept apart to keep each file short. docs/cost_model.md,
"Asynchronous step", states the assumptions:

* eta = 1 on the recipe's separate trainer and rollout nodes: step s+1 generates while step s
  trains, so in steady state a step costs the longer of the two sides instead of their sum;
* the weight update lands while the next step generates (pause -> update -> continue): the engines
  stop for the broadcast, so it stays on both sides' path: async step = max(rollout + re-prefill,
  log-probs + update) + sync (the ideal `max(rollout, train + sync)` holds only for engines that
  keep generating through the transfer; the difference is the 3 s broadcast);
* `rollout.partial_rollout: true` (examples/qwen2.5-32b/dapo-async.yaml): the requests in flight at
  the pause are resubmitted with their prefix, which the engine prefills again once a step: at most
  its running batch x mean live context tokens, at 2 N + attention FLOPs a token on the engine's
  GPUs at `DecodeModel.flops_efficiency` (an upper bound: it assumes the pool is full at the pause);
* the same GPUs as the synchronous step (GPU-hours scale with the step time) plus one rollout to
  fill the pipeline at the start of the run; staleness costs no extra samples (nothing is
  discarded, ALGORITHMS.md section 8) and its effect on the learning curve is not modelled.
"""

from __future__ import annotations


def async_step(st: dict, reprefill_s: float = 0.0) -> dict:
    """The eta = 1 step from a synchronous `step_time` result `st` (`rollout_s`, `logprob_s`,
    `update_s`, `weight_sync_s`, `step_s`, `gpus`): seconds of each side, of the step, and the
    speed-up over the synchronous step.

    Args:
        st: `cost_model.step_time`'s dict (or any dict with those keys).
        reprefill_s: engine seconds a step spent prefilling resubmitted prefixes again
            (`reprefill_s`); 0 = in-place pauses or nothing in flight.
    """
    rollout = st["rollout_s"] + reprefill_s
    train = st["logprob_s"] + st["update_s"]
    step = max(rollout, train) + st["weight_sync_s"]
    return {"rollout_side_s": rollout, "train_side_s": train, "weight_sync_s": st["weight_sync_s"],
            "reprefill_s": reprefill_s, "async_step_s": step, "sync_step_s": st["step_s"],
            "speedup": st["step_s"] / step, "bound": "rollout" if rollout >= train else "train", "gpus": st["gpus"]}


def async_run_cost(st: dict, steps: int, reprefill_s: float = 0.0) -> dict:
    """Wall hours and GPU-hours of `steps` eta = 1 steps (plus one rollout that fills the pipeline)
    against the synchronous run of `st`."""
    a = async_step(st, reprefill_s)
    hours = (steps * a["async_step_s"] + st["rollout_s"]) / 3600
    sync_hours = steps * st["step_s"] / 3600
    return {**a, "steps": steps, "wall_hours": hours, "gpu_hours": hours * a["gpus"],
            "sync_wall_hours": sync_hours, "sync_gpu_hours": sync_hours * a["gpus"]}


def reprefill_s(cm, shape, recipe, cluster, dm=None) -> float:
    """Upper bound on one engine's seconds to prefill again the prefixes of its running requests
    after an update (partial rollouts): running batch x mean live context tokens (`engine_throughput`
    at the recipe's context) x (2 N + 2 h L x context) FLOPs / (TP x bf16 peak x flops efficiency).
    `cm` is the cost_model module."""
    dm = dm or cm.DecodeModel()
    ctx = recipe.mean_live_context()
    eng = cm.engine_throughput(shape, cluster.gpu, cluster.engine, ctx, dm)
    flops_per_token = 2 * shape.total_params() + 2 * shape.hidden * shape.layers * ctx
    rate = cluster.engine.tp * cluster.gpu.bf16_tflops * 1e12 * dm.flops_efficiency
    return eng["batch"] * ctx * flops_per_token / rate


def async_section(cm, shape, recipe, cluster, steps: int, splits=((4, 4), (4, 6), (4, 8), (2, 6), (4, 12))) -> dict:
    """Print and return the eta = 1 step against the synchronous one for the node splits `splits`
    (trainer, rollout nodes; the recipes' 4 + 4 first). `cm` is the cost_model module."""
    from dataclasses import replace

    print(f"\nAsynchronous step (eta = 1, disaggregated; docs/cost_model.md \"Asynchronous step\"), {steps} steps:")
    print(f"{'trainer+rollout nodes':22s} {'rollout+reprefill s':>19s} {'train s':>7s} {'sync min':>8s} "
          f"{'async min':>9s} {'speed-up':>8s} {'sync GPU-h':>10s} {'async GPU-h':>11s}")
    rows = []
    for tn, rn in splits:
        c = replace(cluster, trainer_nodes=tn, rollout_nodes=rn)
        st = cm.step_time(shape, recipe, c)
        r = async_run_cost(st, steps, reprefill_s(cm, shape, recipe, c))
        rows.append({"trainer_nodes": tn, "rollout_nodes": rn, **r})
        print(f"{tn:>10d} + {rn:<9d} {r['rollout_side_s']:19.0f} {r['train_side_s']:7.0f} {r['sync_step_s'] / 60:8.1f} "
              f"{r['async_step_s'] / 60:9.1f} {r['speedup']:7.2f}x {r['sync_gpu_hours']:10.0f} {r['gpu_hours']:11.0f}"
              f"  ({r['bound']}-bound)")
    return {"eta": 1, "splits": rows}
