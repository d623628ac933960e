"""Reinforcement learning on verifiable rewards for ReFusion (`python -m refusion_jax.rl`).

`trainer`: GRPO with exact trajectory log-probabilities of the parallel decode, a task
of the training loop wired from `rollout` (the engine's samples, each token's deciding
pass recorded), `scoring` (their log-probabilities under given weights, `replay`: one
forward over each rollout's layout) and `learner` (GRPO's loss and the update, `grpo`'s
formulas); `selector`: the slot-selection policy's likelihood; `rewards`: the verifiable
rewards (exact match, GSM8K and MATH answer checks, sandboxed HumanEval / MBPP tests).
"""
