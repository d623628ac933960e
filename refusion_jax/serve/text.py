"""Text that can no longer change, from a growing committed token prefix."""

from __future__ import annotations

from typing import Callable, Sequence


def _held_back(text: str, stops: Sequence[str]) -> int:
  """Length of the longest suffix of `text` that begins some stop string (it may yet
  become one, so it is not sent)."""
  best = 0
  for stop in stops:
    for n in range(min(len(stop) - 1, len(text)), best, -1):
      if text.endswith(stop[:n]):
        best = n
        break
  return best


class TextStream:
  """Turns a growing token prefix into text deltas that are never revised.

  `update(tokens, final)` takes the whole committed prefix so far (each call a
  longer or equal one) and returns the new text to send. Text is the decode of
  the tokens (special tokens skipped); until `final`, a trailing incomplete
  character (U+FFFD from a cut multibyte sequence) and a suffix that might begin
  a stop string are held back. Once a stop string appears, the text ends before
  it, `stopped` is set, and `tokens` is cut to the fewest tokens whose text holds
  the stop string.
  """

  def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()):
    self.decode = decode
    self.stops = [s for s in stops if s]
    self.sent = ""
    self.tokens: list[int] = []
    self.stopped = False

  def _stop_at(self, text: str) -> int:
    found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
    return min(found) if found else -1

  def update(self, tokens: Sequence[int], final: bool = False) -> str:
    if self.stopped:
      return ""
    self.tokens = list(tokens)
    text = self.decode(self.tokens)
    cut = self._stop_at(text)
    if cut >= 0:
      self.stopped = True
      for n in range(1, len(self.tokens) + 1):
        if self._stop_at(self.decode(self.tokens[:n])) >= 0:
          self.tokens = self.tokens[:n]
          break
      safe = text[:cut]
    elif final:
      safe = text
    else:
      safe = text.rstrip("\ufffd")
      safe = safe[:len(safe) - _held_back(safe, self.stops)]
    if not safe.startswith(self.sent) or len(safe) <= len(self.sent):
      return ""
    delta, self.sent = safe[len(self.sent):], safe
    return delta
