"""The embedded rollout server: an HF transformers model on CPU behind SGLang 0.5.23's HTTP API.

Run as its own process::

    python -m megatron_rl.engine --model-path DIR [--host 127.0.0.1] [--port 30000]
        [--dtype float32] [--api-key K] [--admin-api-key K] [--weight-version V]
        [--max-batch-size 256] [--random-seed S] [--enable-deterministic-inference]
        [--context-length N]

It speaks the subset of SGLang's API that the trainer uses (docs/SGLANG_API.md), with
the same request fields, the same strict ``sampling_params``, the same ``{}``-body rule for
control endpoints, the same response and ``finish_reason`` shapes, the same weight-update
session and the same auth semantics, so the trainer cannot tell it from SGLang. It runs
ids-in/ids-out (like ``--skip-tokenizer-init``): ``text`` prompts and stop *strings* are refused.

With ``--api-dialect vllm`` it serves vLLM 0.33.x's paths and bodies instead (docs/VLLM_API.md):
a stand-in for a vLLM server where vLLM cannot run (CPU machines), the `vllm-embedded` backend.

Modules, lowest first (none imports the trainer, the rollout client side or the config):

- ``bodies``: request bodies and the client-error answer (``RequestError``) of the HTTP API;
- ``sampling``: the sampling contract: ``SamplingParams``, ``parse_sampling_params``, one token draw;
- ``batching``: ``GenerationEngine``, the batched, KV-cached scheduler thread;
- the receiver's weight-update session (``UpdateSession``) and the model-update lock live in
  ``megatron_rl.weight_sync.session`` (DESIGN.md "Layout": the weight path is in ``weight_sync``);
- ``test_hooks``: fault injection driven by environment variables, for tests only;
- ``app``: the FastAPI app (thin handlers over the engine and the session);
- ``vllm_dialect``: the same engine and session behind vLLM's paths (``--api-dialect vllm``);
- ``server`` / ``__main__``: flags, model loading, parent watchdog, ``main()``.

This package module imports nothing, so ``megatron_rl.engine.test_hooks`` stays cheap to import.
"""
