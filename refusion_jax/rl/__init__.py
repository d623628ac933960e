"""Reinforcement learning on verifiable rewards for ReFusion (`python -m refusion_jax.rl`).

`trainer`: GRPO with exact trajectory log-probabilities of the parallel decode
(`replay`); `rewards`: the verifiable rewards (exact match, GSM8K and MATH
answer checks, sandboxed HumanEval / MBPP tests).
"""
