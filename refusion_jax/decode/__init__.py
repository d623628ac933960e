"""Decoders: ReFusion's plan-and-infill and the AR, MDM, BD3-LM and D2F baselines.

The map: `methods` (each method's options and `DecodeConfig`, no JAX), `program` (the
row-program protocol every method implements), `refusion`, `autoregressive`, `mdm`,
`bd3lm`, `d2f` (the programs, loaded on first use by `program.program`), `heads`
(the token picker) and `passes` (the pass builder) they share, `compiled` (the jitted
functions), `engine` (`Decoder`, the offline `Engine`), `live` (the server's
`LiveBatch`). Importing this package loads none of them.
"""
