"""Decoders: ReFusion's plan-and-infill and the AR, MDM, BD3-LM and D2F baselines.

Every decoder is a row program of `engine` (one protocol, one registry, one
token picker in `heads`, one pass builder in `passes`). Entry points:
`engine.Decoder(model, decode_config)` (`.generate`, `.engine(rows)`) or the
per-method `generate` functions.
"""

from refusion_jax.decode import (  # noqa: F401  (registers)
    autoregressive, bd3lm, d2f, engine, mdm, refusion)
from refusion_jax.decode.engine import Decoder, Engine, generate  # noqa: F401
