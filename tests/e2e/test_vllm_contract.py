"""The trainer side of vLLM's NCCL weight transfer checked against vLLM 0.33's own code.

Runs only where vLLM is installed in its own environment (it pins its own torch; about 8 GB; it
imports on CPU): ``VLLM_VENV`` names that venv (``python3.12 -m venv /work/venv-vllm &&
/work/venv-vllm/bin/pip install "vllm==0.33.*"``); without it ``/work/venv-vllm`` is used when
present, otherwise the tests skip.

On CPU:
1. the store rendezvous: the trainer's ``StoreRendezvous`` (rank 0, this torch) and two ranks
   running vLLM's own ``StatelessProcessGroup.create`` + ``broadcast_obj(ncclUniqueId(), src=0)``
   (what ``PyNcclCommunicator.__init__`` does on a worker), in vLLM's python: both workers get the
   trainer's unique id as vLLM's ``ncclUniqueId``, the type ``ncclCommInitRank`` takes, and vLLM
   pickles that id to exactly the trainer's bytes;
2. the ``init_info`` / ``update_info`` bodies ``VLLMClient`` posts pass vLLM's
   ``NCCLWeightTransferInitInfo`` / ``NCCLWeightTransferUpdateInfo``, every dtype name resolves
   as the worker resolves it (``getattr(torch, name)``), and the trainer's NCCL dtype numbers
   are vLLM's ``ncclDataTypeEnum.from_torch``.
3. Mixture-of-Experts (issue 29): the launcher's ``--enable-expert-parallel`` and
   ``--enable-return-routed-experts`` parse with ``vllm serve``'s own parser; vLLM has no request
   flag for routing (``routed_experts_prompt_start`` only), and a completion answer assembled by
   ``OpenAIServingCompletion`` from an engine output with routing decodes in the client to the same
   array (docs/VLLM_API.md 1b). Needs ``VLLM_TARGET_DEVICE=cpu`` on a machine without GPUs (set by
   the test) for vLLM's argument parser.
Not on CPU: ``ncclCommInitRank``, the warm-up all-reduce and the broadcasts. The last test does
them against vLLM's worker-side ``stateless_init_process_group`` and needs 2 CUDA GPUs.
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

from megatron_rl.ports import find_free_port
from megatron_rl.weight_sync import vllm_nccl as vn


def _vllm_python() -> str | None:
    venv = os.environ.get("VLLM_VENV") or ("/work/venv-vllm" if Path("/work/venv-vllm").is_dir() else None)
    python = Path(venv) / "bin" / "python" if venv else None
    return str(python) if python is not None and python.exists() else None


VLLM_PYTHON = _vllm_python()
pytestmark = pytest.mark.skipif(VLLM_PYTHON is None, reason="no vLLM venv (set VLLM_VENV, see the module docstring)")

WORKER_JOINS_STORE = r'''
import json, pickle, sys
from vllm.distributed.utils import StatelessProcessGroup
from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary, ncclUniqueId
port, rank, world_size = map(int, sys.argv[1:4])
pg = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=rank, world_size=world_size)
uid = pg.broadcast_obj(ncclUniqueId(), src=0)  # pynccl.py: a rank != 0 takes rank 0's id
init_rank = next(f for f in NCCLLibrary.exported_functions if f.name == "ncclCommInitRank")
print("RESULT " + json.dumps({"vllm_class": type(uid) is ncclUniqueId,
                              "fits_ncclCommInitRank": isinstance(uid, init_rank.argtypes[2]),
                              "hex": bytes(uid).hex(), "repickled": pickle.dumps(uid).hex()}))
'''

CHECK_INFOS = r'''
import json, sys, torch
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo
from vllm.distributed.device_communicators.pynccl_wrapper import ncclDataTypeEnum
data = json.load(sys.stdin)
out = {}
for i, info in enumerate(data["init"]):
    try:
        NCCLWeightTransferInitInfo(**info); out[f"init{i}"] = "ok"
    except Exception as e:
        out[f"init{i}"] = f"{type(e).__name__}: {e}"
for i, info in enumerate(data["update"]):
    try:
        NCCLWeightTransferUpdateInfo(**info)
        [getattr(torch, name) for name in info["dtype_names"]]  # NCCLWeightTransferEngine.receive_weights
        out[f"update{i}"] = "ok"
    except Exception as e:
        out[f"update{i}"] = f"{type(e).__name__}: {e}"
out["dtypes"] = {name: ncclDataTypeEnum.try_from_torch(getattr(torch, name)) for name in data["dtypes"]}
print("RESULT " + json.dumps(out))
'''


def _result(proc: subprocess.CompletedProcess) -> dict:
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _unique_id() -> bytes:
    try:
        return vn.NcclLibrary.load().get_unique_id()  # torch's NCCL mints ids without a GPU
    except vn.NcclUnavailableError:
        return bytes((7 * i + 3) % 256 for i in range(128))


def test_vllm_workers_get_the_trainers_unique_id_through_the_store():
    port, world_size = find_free_port("127.0.0.1"), 3
    procs = [subprocess.Popen([VLLM_PYTHON, "-c", WORKER_JOINS_STORE, str(port), str(rank), str(world_size)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (1, 2)]
    try:
        rdv = vn.StoreRendezvous("127.0.0.1", port, world_size, timeout_s=300)  # waits for both (vLLM imports ~15 s)
        raw = _unique_id()
        payload = vn.pickle_vllm_unique_id(raw)
        assert rdv.broadcast_pickled(payload) == "broadcast_from/0/0"
        results = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            results.append(_result(subprocess.CompletedProcess(p.args, p.returncode, out, err)))
        rdv.close()
    finally:
        for p in procs:
            p.kill()
    for got in results:
        assert got == {"vllm_class": True, "fits_ncclCommInitRank": True, "hex": raw.hex(), "repickled": payload.hex()}


def _captured_infos() -> tuple[list[dict], list[dict]]:
    from megatron_rl.rollout.vllm_client import VLLMClient

    seen: dict[str, list[dict]] = {"init": [], "update": []}

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        if request.url.path == "/init_weight_transfer_engine":
            seen["init"].append(body["init_info"])
            return httpx.Response(200, json={"message": "Weight transfer initialized"})
        seen["update"].append(body["update_info"])
        return httpx.Response(200, json={"message": "Weights updated"})

    c = VLLMClient("http://vllm", transport=httpx.MockTransport(handler), max_retries=0)
    c.init_weights_update_group("10.0.0.1", 29500, 1, 9)
    c.update_weights_from_distributed(["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"],
                                      ["bfloat16", "float32", "float16"], [[16, 8], [8], [16, 8]])
    c.close()
    return seen["init"], seen["update"]


def test_weight_transfer_bodies_and_dtypes_pass_vllms_own_classes():
    init, update = _captured_infos()
    bad_init = {"master_address": "h", "master_port": 1, "world_size": 2}  # no rank_offset: vLLM refuses
    bad_update = {"names": ["a"], "dtype_names": [], "shapes": [[1]]}
    dtypes = [str(d).removeprefix("torch.") for d in vn._NCCL_DTYPES]
    proc = subprocess.run([VLLM_PYTHON, "-c", CHECK_INFOS], capture_output=True, text=True, timeout=600,
                          input=json.dumps({"init": init + [bad_init], "update": update + [bad_update],
                                            "dtypes": dtypes}))
    got = _result(proc)
    assert got["init0"] == "ok" and got["update0"] == "ok", got
    assert "rank_offset" in got["init1"] and "dtype_names" in got["update1"], got  # the check can fail
    assert got["dtypes"] == {name: vn.nccl_dtype(getattr(torch, name)) for name in dtypes}


WORKER_RECEIVES = r'''
import json, sys, torch
from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
port, rank, world_size, device = map(int, sys.argv[1:5])
info = json.loads(sys.argv[5])
torch.cuda.set_device(device)
comm = stateless_init_process_group("127.0.0.1", port, rank, world_size, device=device)
sums = []
for name, dtype_name, shape in zip(info["names"], info["dtype_names"], info["shapes"]):  # receive_weights, unpacked
    w = torch.empty(shape, dtype=getattr(torch, dtype_name), device=f"cuda:{device}")
    comm.broadcast(w, src=0, stream=torch.cuda.current_stream())
    sums.append(float(w.double().sum()))
print("RESULT " + json.dumps(sums))
'''


@pytest.mark.gpu(2)
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs (the trainer on cuda:0, a vLLM rank on cuda:1)")
def test_broadcast_reaches_vllms_worker_communicator():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(64, 32, generator=g).to(torch.bfloat16), torch.randn(32, generator=g),
               torch.randint(0, 100, (7, 3), generator=g)]
    info = {"names": ["a", "b", "c"], "dtype_names": ["bfloat16", "float32", "int64"],
            "shapes": [list(t.shape) for t in tensors]}
    port = find_free_port("127.0.0.1")
    proc = subprocess.Popen([VLLM_PYTHON, "-c", WORKER_RECEIVES, str(port), "1", "2", "1", json.dumps(info)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(zip(("stdout", "stderr"), proc.communicate(timeout=600))))
    t.start()
    group = None
    try:
        torch.cuda.set_device(0)
        group = vn.VllmNcclGroup.join("127.0.0.1", port, 2, timeout_s=300, device=0)
        group.broadcast([x.cuda(0) for x in tensors]).wait(timeout=120)
        t.join(timeout=600)
    finally:
        if group is not None:
            group.destroy()
        proc.kill()
    got = _result(subprocess.CompletedProcess(proc.args, proc.returncode, out.get("stdout", ""), out.get("stderr", "")))
    assert got == [float(x.double().sum()) for x in tensors]


# ---- Mixture-of-Experts: expert parallelism and routed experts (issue 29; docs/VLLM_API.md 1b) ------------------

CHECK_ROUTED = r'''
import json, sys
import numpy as np
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput

data = json.load(sys.stdin)
out = {}
a = make_arg_parser(FlexibleArgumentParser()).parse_args(data["serve_args"])   # `vllm serve`'s own parser
out["serve"] = {k: getattr(a, k) for k in ("model_tag", "tensor_parallel_size", "enable_expert_parallel",
                                           "enable_return_routed_experts")}
body = data["body"]
fields = CompletionRequest.model_fields
out["fields"] = {k: k in fields for k in ("routed_experts_prompt_start", "return_routed_experts")}
req = CompletionRequest.model_validate(body)
out["ignored"] = sorted(set(body) - fields.keys())
start = CompletionRequest.model_validate({**body, "routed_experts_prompt_start": 3})
out["prompt_start"] = [req.to_sampling_params(req.max_tokens, {}).routed_experts_prompt_start,
                       start.to_sampling_params(start.max_tokens, {}).routed_experts_prompt_start]
try:
    CompletionRequest.model_validate({**body, "routed_experts_prompt_start": -1})
    out["negative"] = "accepted"
except Exception as e:
    out["negative"] = type(e).__name__
# the answer, assembled by vLLM's own serving code from an engine output carrying the routing
serving = object.__new__(OpenAIServingCompletion)
serving.enable_prompt_tokens_details = False
serving.enable_per_request_metrics = False
serving.system_fingerprint = None
serving.return_tokens_as_token_ids = False
ids = data["output_ids"]
output = CompletionOutput(index=0, text="", token_ids=ids, cumulative_logprob=None,
                          logprobs=[{t: Logprob(logprob=-0.5, rank=1, decoded_token=None)} for t in ids],
                          finish_reason="length", stop_reason=None,
                          routed_experts=np.asarray(data["routed"], dtype=data["dtype"]))
engine_id = f"cmpl-{req.request_id}"
final = RequestOutput(request_id=f"{engine_id}-0", prompt=None, prompt_token_ids=list(req.prompt),
                      prompt_logprobs=None, outputs=[output], finished=True)
resp = serving.request_output_to_completion_response([final], req, engine_id, 1, "Qwen/x", None,
                                                     RequestResponseMetadata(request_id=engine_id))
out["answer"] = json.loads(resp.model_dump_json())
print("RESULT " + json.dumps(out))
'''


def test_moe_flags_and_routed_experts_answer_against_vllm():
    """vLLM 0.33's own code: the `vllm serve` line of `build_vllm_command` for an MoE engine parses with
    `--enable-expert-parallel` and `--enable-return-routed-experts` set; a completion body of `VLLMClient`
    asking for routing passes `CompletionRequest` (vLLM has no request flag, only `routed_experts_prompt_start`,
    >= 0, which reaches SamplingParams); the answer assembled by `OpenAIServingCompletion` from an engine output
    carrying uint8 [prompt + output - 1, layers, top-k] routing (the capturer's dtype for <= 256 experts) is read
    back by the client to the same array."""
    import numpy as np

    from megatron_rl.rollout.launcher import build_vllm_command
    from megatron_rl.rollout.result import RoutedExpertsSpec
    from megatron_rl.rollout.vllm_client import VLLMClient, result_from_vllm

    spec = RoutedExpertsSpec(num_layers=3, topk=2, num_experts=8)
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(400, json={"error": "captured"})

    c = VLLMClient("http://vllm", transport=httpx.MockTransport(handler), max_retries=0)
    with pytest.raises(Exception):
        c.generate([1, 2, 3, 4], {"max_new_tokens": 2, "sampling_seed": 1}, rid="r0", routed_experts=spec)
    c.close()
    cmd = build_vllm_command("/ckpt", python=VLLM_PYTHON, host="127.0.0.1", port=8000, tp_size=4,
                             enable_expert_parallel=True, enable_return_routed_experts=True)
    routed = (np.arange(5 * 3 * 2).reshape(5, 3, 2) % 8).astype(np.uint8)  # 4 prompt + 2 output - 1 positions
    proc = subprocess.run([VLLM_PYTHON, "-c", CHECK_ROUTED], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VLLM_TARGET_DEVICE": os.environ.get("VLLM_TARGET_DEVICE", "cpu")},
                          input=json.dumps({"serve_args": cmd[4:], "body": seen[0], "output_ids": [11, 12],
                                            "routed": routed.tolist(), "dtype": "uint8"}))
    got = _result(proc)
    assert got["serve"] == {"model_tag": "/ckpt", "tensor_parallel_size": 4, "enable_expert_parallel": True,
                            "enable_return_routed_experts": True}
    assert got["fields"] == {"routed_experts_prompt_start": True, "return_routed_experts": False}
    assert got["ignored"] == [] and "return_routed_experts" not in seen[0]
    assert got["prompt_start"] == [0, 3] and got["negative"] == "ValidationError"
    choice = got["answer"]["choices"][0]
    assert isinstance(choice["routed_experts"], str)
    res = result_from_vllm(got["answer"], rid="r0", routed_experts=spec)
    assert np.array_equal(res.routed_experts, routed) and res.routed_experts.shape == (5, 3, 2)
