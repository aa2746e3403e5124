"""RL algorithm math: advantages, DAA, policy losses, aggregation, dynamic sampling, shaping, KL.

Imports only the standard library and torch, so every module here is testable alone; `options`
(the registered names and their option dataclasses) imports no torch, so `megatron_rl.config`
can use it.
The exact semantics live in docs/ALGORITHMS.md; each module cites its section.
"""
