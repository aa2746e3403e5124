"""The client's request bodies and the weight-sync group checked against SGLang's own code.

Runs only where SGLang is installed in its own environment (it pins its own torch; about 11 GB):
set ``MEGATRON_RL_SGLANG_PYTHON`` to that environment's python (e.g. ``/work/sglang-venv/bin/python``
with ``pip install sglang==0.5.23``; SGLang imports on CPU). Otherwise the tests skip.

1. Every body ``RolloutClient`` sends (captured with an ``httpx.MockTransport``) is validated by
   SGLang's request classes from ``sglang.srt.managers.io_struct`` and, for ``/generate``, by its
   sampling-params check, in SGLang's python.
2. The trainer side of the weight-update group (``megatron_rl.weight_sync.group``, rank 0) and
   SGLang's own ``init_custom_process_group`` (rank 1, in SGLang's python) form one gloo group and a
   bucket broadcast from the trainer arrives intact.
3. Mixture-of-Experts (issue 29): the launcher's ``--ep-size`` / ``--enable-return-routed-experts``
   parse with ``ServerArgs``; ``return_routed_experts`` bodies pass ``GenerateReqInput`` and the
   /generate contract gate; the rows SGLang's capturer returns (``BaseTopkCapturer.get_topk``) and
   their wire form (``DetokenizerManager._b64_encode_per_request``) decode in the client to the same
   [prompt + output - 1, layers, top-k] array (docs/SGLANG_API.md 2.11).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import httpx
import pytest
import torch

SGLANG_PYTHON = os.environ.get("MEGATRON_RL_SGLANG_PYTHON")
pytestmark = pytest.mark.skipif(not SGLANG_PYTHON, reason="MEGATRON_RL_SGLANG_PYTHON (SGLang's python) not set")

CHECK_BODIES = r'''
import json, sys
import pydantic
from sglang.srt.managers import io_struct as io
from sglang.srt.sampling.sampling_params import SamplingParams

classes = {
    "/init_weights_update_group": io.InitWeightsUpdateGroupReqInput,
    "/destroy_weights_update_group": io.DestroyWeightsUpdateGroupReqInput,
    "/update_weights_from_distributed": io.UpdateWeightsFromDistributedReqInput,
    "/begin_weight_update": getattr(io, "BeginWeightUpdateReqInput", None),
    "/end_weight_update": getattr(io, "EndWeightUpdateReqInput", None),
    "/pause_generation": io.PauseGenerationReqInput,
    "/continue_generation": io.ContinueGenerationReqInput,
    "/abort_request": io.AbortReq,
    "/update_weight_version": io.UpdateWeightVersionReqInput,
    "/get_weights_by_name": io.GetWeightsByNameReqInput,
    "/generate": io.GenerateReqInput,
}
out = []
for path, body in json.load(sys.stdin):
    cls = classes.get(path)
    if cls is None:
        out.append("no request class")
        continue
    try:
        # FastAPI validates the body with this pydantic schema (msgspec Structs bring their own)
        obj = pydantic.TypeAdapter(cls).validate_python(body)
        # SGLang ignores unknown top-level keys; a key it would ignore is a bug on our side
        fields = set(getattr(cls, "__struct_fields__", None) or getattr(cls, "model_fields", None)
                     or getattr(cls, "__dataclass_fields__", {}))
        unknown = sorted(set(body) - fields)
        if unknown:
            raise ValueError(f"keys {unknown} are not fields of {cls.__name__}")
        if path == "/generate":
            sp = SamplingParams(**body["sampling_params"])
            sp.verify(vocab_size=1000)
        out.append("ok")
    except Exception as e:
        out.append(f"{type(e).__name__}: {e}")
print("RESULT " + json.dumps(out))
'''

JOIN_GROUP = r'''
import sys, torch, torch.distributed as dist
try:
    from sglang.srt.utils import init_custom_process_group
except ImportError:
    from sglang.srt.utils.common import init_custom_process_group
port, nbytes = int(sys.argv[1]), int(sys.argv[2])
pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1,
                               group_name="sglang_contract")
buf = torch.empty(nbytes, dtype=torch.uint8)
dist.broadcast(buf, src=0, group=pg)
print("RESULT " + str(int(buf.to(torch.int64).sum())))
'''


def _captured_bodies() -> list[tuple[str, dict]]:
    from megatron_rl.rollout.client import RolloutClient

    seen: list[tuple[str, dict]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        seen.append((request.url.path, body))
        if request.url.path == "/generate":
            return httpx.Response(200, json={"output_ids": [7], "meta_info": {
                "id": body["rid"], "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 2,
                "completion_tokens": 1, "output_token_logprobs": [[-0.1, 7, None]], "weight_version": "1"}})
        if request.url.path == "/get_weights_by_name":
            return httpx.Response(200, json=[0.0])
        if request.url.path == "/abort_request":
            return httpx.Response(200)
        return httpx.Response(200, json={"success": True, "message": ""})

    c = RolloutClient("http://sglang", transport=httpx.MockTransport(handler))
    c.generate([1, 2], {"max_new_tokens": 4, "temperature": 1.0, "top_p": 0.9, "top_k": 5, "sampling_seed": 3,
                        "stop_token_ids": [2]}, rid="s1-b0-p0-r0")
    c.init_weights_update_group("127.0.0.1", 29500, 1, 2, "weight_update_group", "nccl")
    c.begin_weight_update()
    c.update_weights_from_distributed(["a.weight"], ["bfloat16"], [[2, 3]], flush_cache=False, weight_version="1",
                                      load_format="flattened_bucket")
    # weight_sync.load_format null: one broadcast per tensor, the field left to SGLang's default
    c.update_weights_from_distributed(["a.weight", "b.bias"], ["bfloat16", "float32"], [[2, 3], [3]],
                                      flush_cache=False, weight_version=None, load_format=None)
    c.end_weight_update()
    c.destroy_weights_update_group()
    c.pause_generation("abort")
    c.continue_generation()
    c.abort_request("s1-b0-")
    c.update_weight_version("2")
    c.get_weights_by_name("model.norm.weight", truncate_size=4)
    c.close()
    return seen


def test_client_bodies_pass_sglang_request_classes():
    bodies = _captured_bodies()
    assert len({p for p, _ in bodies}) == 11
    # controls: the check must refuse what SGLang refuses
    bad = [("/generate", {"input_ids": [1], "sampling_params": {"max_tokens": 4}}),
           ("/init_weights_update_group", {"master_address": "h", "master_port": 1, "rank_offset": 1})]
    proc = subprocess.run([SGLANG_PYTHON, "-c", CHECK_BODIES], input=json.dumps(bodies + bad), capture_output=True,
                          text=True, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert dict(zip([p for p, _ in bodies], result)) == {p: "ok" for p, _ in bodies}, result
    assert "max_tokens" in result[-2] and "world_size" in result[-1], result[-2:]


def test_trainer_group_joins_sglang_init_custom_process_group():
    import torch.distributed as dist

    from megatron_rl.ports import find_free_port
    from megatron_rl.weight_sync.group import destroy_custom_process_group, init_custom_process_group

    port, nbytes = find_free_port(), 1 << 20
    out: dict = {}

    def run_sglang_side():
        p = subprocess.run([SGLANG_PYTHON, "-c", JOIN_GROUP, str(port), str(nbytes)], capture_output=True, text=True,
                           timeout=600)
        out["proc"] = p

    t = threading.Thread(target=run_sglang_side)
    t.start()
    pg = init_custom_process_group(backend="gloo", host="127.0.0.1", port=port, world_size=2, rank=0,
                                   group_name="sglang_contract", timeout_s=300)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    dist.broadcast(data, src=0, group=pg)
    t.join(timeout=600)
    destroy_custom_process_group(pg)
    p = out["proc"]
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    assert int(lines[-1].split()[1]) == int(data.to(torch.int64).sum())


def test_sglang_launch_server_accepts_our_flags():
    """The command line ``build_sglang_command`` writes parses with SGLang's own ServerArgs."""
    from megatron_rl.rollout.launcher import build_sglang_command

    cmd = build_sglang_command("/ckpt", python=SGLANG_PYTHON, host="127.0.0.1", port=30000, nccl_port=30001,
                               tp_size=2, mem_fraction_static=0.7, random_seed=1, enable_deterministic_inference=True,
                               dtype="bfloat16", weight_version="0", api_key="k", admin_api_key="a")
    code = ("import argparse, json, sys\nfrom sglang.srt.server_args import ServerArgs\n"
            "p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)\n"
            "a = p.parse_args(sys.argv[1:])\n"
            "print('RESULT ' + json.dumps({k: getattr(a, k) for k in ('model_path', 'port', 'nccl_port', 'tp_size', "
            "'mem_fraction_static', 'skip_tokenizer_init', 'random_seed', 'enable_deterministic_inference', 'dtype', "
            "'weight_version')}))")
    p = subprocess.run([SGLANG_PYTHON, "-c", code, *cmd[3:]], capture_output=True, text=True, timeout=600)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got == {"model_path": "/ckpt", "port": 30000, "nccl_port": 30001, "tp_size": 2, "mem_fraction_static": 0.7,
                   "skip_tokenizer_init": True, "random_seed": 1, "enable_deterministic_inference": True,
                   "dtype": "bfloat16", "weight_version": "0"}


# ---- Mixture-of-Experts: routed experts (issue 29; docs/SGLANG_API.md 2.11) -------------------------------------

ROUTED = r'''
import base64, json, sys, types
import pydantic, torch
from sglang.srt.managers import io_struct as io
from sglang.srt.entrypoints.api_contract import generate_contract_error
from sglang.srt.managers.detokenizer_manager import DetokenizerManager
from sglang.srt.state_capturer.base import BaseTopkCapturer, BaseDeviceCache
from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

data = json.load(sys.stdin)
out = {"bodies": []}
fields = {f.name: str(f.type) for f in __import__("dataclasses").fields(io.GenerateReqInput)}
out["fields"] = {k: fields.get(k) for k in ("return_routed_experts", "routed_experts_start_len")}
for body in data["bodies"]:
    try:
        obj = pydantic.TypeAdapter(io.GenerateReqInput).validate_python(body)   # what FastAPI parses
        gate = generate_contract_error(body)                                  # the /generate contract gate
        out["bodies"].append({"ok": gate is None, "gate": gate, "return_routed_experts": obj.return_routed_experts,
                              "routed_experts_start_len": obj.routed_experts_start_len,
                              "unknown": sorted(set(body) - set(fields))})
    except Exception as e:
        out["bodies"].append({"ok": False, "error": f"{type(e).__name__}: {e}"})
# the capture buffers are int32 [rows, layers, top-k] (BaseDeviceCache on CPU here)
out["buffer_dtype"] = str(BaseDeviceCache(2, data["layers"], data["topk"], "cpu", "t").buffer.dtype)
# which rows a finished request gets: BaseTopkCapturer.get_topk over a host cache indexed by KV slot,
# req_to_token mapping the request's positions to slots (stand-ins for the GPU pools)
cap = object.__new__(BaseTopkCapturer)
cap.host_cache = types.SimpleNamespace(buffer=torch.tensor(data["host"], dtype=torch.int32))
pool = types.SimpleNamespace(req_to_token=torch.tensor([data["req_to_token"]]))
rows = cap.get_topk(req_pool_idx=0, seqlen=data["seqlen"], req_to_token_pool=pool, start_len=data["start_len"])
out["rows"] = rows.tolist()
# the wire form: DetokenizerManager base64-encodes the tensor's raw bytes (TokenizerManager does the same
# inline on the --skip-tokenizer-init path); SGLang's own reader decodes it back to flat int32
enc = DetokenizerManager._b64_encode_per_request([rows])[0]
out["encoded"] = enc
out["sglang_reads"] = extract_routed_experts_from_meta_info({"meta_info": {"routed_experts": enc}}).tolist()
print("RESULT " + json.dumps(out))
'''


def test_routed_experts_request_fields_and_answer_encoding_against_sglang():
    """The routed-experts round trip with SGLang 0.5.23's own code: `RolloutClient` asks with
    `return_routed_experts: true` (single and batch /generate bodies pass GenerateReqInput, where it is a field,
    and the /generate contract gate, which ignores it as an unknown key); SGLang's capturer returns rows
    [start_len, prompt + output - 1) of int32 [layers, top-k], base64 of their raw bytes; the client decodes that
    answer to the same array and checks it against the model's layout (`RoutedExpertsSpec`)."""
    import numpy as np

    from megatron_rl.rollout.client import GenerateResult, RolloutClient
    from megatron_rl.rollout.result import RoutedExpertsSpec

    spec = RoutedExpertsSpec(num_layers=3, topk=2, num_experts=8)
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        return httpx.Response(400, json={"error": "captured"})  # the answer is checked below, from SGLang's side

    c = RolloutClient("http://sglang", transport=httpx.MockTransport(handler), max_retries=0)
    for call in (lambda: c.generate([1, 2], {"max_new_tokens": 4}, rid="r0", routed_experts=spec),
                 lambda: c.generate_batch([[1, 2], [3]], [{"max_new_tokens": 4}] * 2, ["r1", "r2"], routed_experts=spec)):
        with pytest.raises(Exception):
            call()
    c.close()
    assert [b.get("return_routed_experts") for b in seen] == [True, True]
    # 10 KV slots of routing; the request's 6 positions (prompt 4 + output 2) live in slots 9, 8, ..., 4
    host = (np.arange(10 * 3 * 2, dtype=np.int32).reshape(10, 3, 2) % 8).tolist()
    req = {"bodies": seen + [{**seen[0], "routed_experts_start_len": 2}], "layers": 3, "topk": 2, "host": host,
           "req_to_token": [9, 8, 7, 6, 5, 4, 3, 2, 1, 0], "seqlen": 6, "start_len": 0}
    proc = subprocess.run([SGLANG_PYTHON, "-c", ROUTED], input=json.dumps(req), capture_output=True, text=True,
                          timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got["fields"] == {"return_routed_experts": "bool", "routed_experts_start_len": "int"}  # one for a batch
    assert [(b["ok"], b["return_routed_experts"], b["unknown"]) for b in got["bodies"]] == [(True, True, [])] * 3
    assert got["bodies"][2]["routed_experts_start_len"] == 2
    assert got["buffer_dtype"] == "torch.int32"
    want = np.asarray(host, dtype=np.int32)[[9, 8, 7, 6, 5]]  # positions 0 .. seqlen - 2: the last token is not fed
    assert np.array_equal(np.asarray(got["rows"]), want)
    assert got["sglang_reads"] == want.reshape(-1).tolist()
    answer = {"output_ids": [11, 12], "meta_info": {
        "id": "r0", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 4, "completion_tokens": 2,
        "output_token_logprobs": [[-0.1, 11, None], [-0.2, 12, None]], "weight_version": "1",
        "routed_experts": got["encoded"]}}
    res = GenerateResult.from_sglang(answer, routed_experts=spec)
    assert np.array_equal(res.routed_experts, want) and res.routed_experts.shape == (4 + 2 - 1, 3, 2)


def test_sglang_launch_server_accepts_the_moe_flags():
    """`build_sglang_command` for a Mixture-of-Experts engine parses with SGLang's ServerArgs: `--ep-size`
    (aliases --expert-parallel-size, --ep) and `--enable-return-routed-experts`."""
    from megatron_rl.rollout.launcher import build_sglang_command

    cmd = build_sglang_command("/ckpt", python=SGLANG_PYTHON, host="127.0.0.1", port=30000, nccl_port=30001, tp_size=4,
                               ep_size=4, enable_return_routed_experts=True)
    code = ("import argparse, json, sys\nfrom sglang.srt.server_args import ServerArgs\n"
            "p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)\n"
            "a = p.parse_args(sys.argv[1:])\n"
            "print('RESULT ' + json.dumps({k: getattr(a, k) for k in ('tp_size', 'ep_size', "
            "'enable_return_routed_experts')}))")
    p = subprocess.run([SGLANG_PYTHON, "-c", code, *cmd[3:]], capture_output=True, text=True, timeout=600)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    assert json.loads(lines[-1][len("RESULT "):]) == {"tp_size": 4, "ep_size": 4, "enable_return_routed_experts": True}
