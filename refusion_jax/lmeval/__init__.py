"""The paper's benchmarks through lm-evaluation-harness: our model, task definitions, sandboxed code execution."""
