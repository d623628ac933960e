"""The paper's benchmarks through lm-evaluation-harness: our model, task definitions, sandboxed code execution."""


class GenerativeOnlyError(ValueError):
  """A task asked for log-likelihoods; refusion_jax's models (and replayed completions)
  only answer generate_until requests."""
