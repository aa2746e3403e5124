"""RL algorithm math: advantages, DAA, policy losses, aggregation, dynamic sampling, shaping, KL.

Imports only the standard library and torch, so every module here is testable alone.
The exact semantics live in docs/ALGORITHMS.md; each module cites its section.
"""
