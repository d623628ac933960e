"""Field checks shared by the config validators (training and reproduction).

Each failure names the field and the value: `config.<field> must be <what>, got <value>`.
"""

from __future__ import annotations

import math
import numbers


class InputError(ValueError):
  """A bad setting or input, named in the message.

  Entry points report it as one `error:` line and exit status 2, without a
  traceback (refusion_jax.entry_flags.run_program); it is a ValueError, so
  library callers that catch ValueError still catch it.
  """


def is_int(value) -> bool:
  """An integer that is not a bool (`True` would pass as 1 otherwise)."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
  """A finite real number that is not a bool (nan and +-inf are refused: every field
  checked with it is a rate, a weight, a bound or a probability)."""
  return (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value))


def require(condition: bool, field: str, value, what: str) -> None:
  """Raises InputError("config.FIELD must be WHAT, got VALUE") unless `condition`."""
  if not condition:
    raise InputError(f"config.{field} must be {what}, got {value!r}")
