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

  With `concatenates` (a decoder for which `decode(a + b) == decode(a) + decode(b)`
  where `decode(a)` ends in a whole character: `Tokenizer.decodes_by_concatenation`),
  an update decodes only the tokens since the last whole character, so a stream of
  n tokens costs O(n) instead of O(n^2); the texts are the same.
  """

  def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = (),
               concatenates: bool = False):
    self.decode = decode
    self.stops = [s for s in stops if s]
    self._longest_stop = max(map(len, self.stops), default=1)
    self.concatenates = concatenates
    self.sent = ""
    self.tokens: list[int] = []
    self.stopped = False
    self._whole = 0  # concatenates: tokens[:_whole] decode to _whole_text, no cut character
    self._whole_text = ""

  def _stop_at(self, text: str, start: int = 0) -> int:
    found = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
    return min(found) if found else -1

  def _text(self) -> str:
    if not self.concatenates:
      return self.decode(self.tokens)
    tail = self.decode(self.tokens[self._whole:])
    text = self._whole_text + tail
    if not tail.endswith("\ufffd"):
      self._whole, self._whole_text = len(self.tokens), text
    return text

  def update(self, tokens: Sequence[int], final: bool = False) -> str:
    if self.stopped:
      return ""
    self.tokens = list(tokens)
    text = self._text()
    # What was sent holds no stop string, so one can only begin in its last characters.
    cut = self._stop_at(text, max(0, len(self.sent) - self._longest_stop + 1))
    if cut >= 0:
      self.stopped = True
      self.tokens = self.tokens[:self._fewest_holding_a_stop()]
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

  def _fewest_holding_a_stop(self) -> int:
    """The fewest leading tokens whose text holds a stop string (the whole list's
    does): a binary search, since a longer prefix's text extends a shorter one's."""
    lo, hi = 1, len(self.tokens)
    while lo < hi:
      mid = (lo + hi) // 2
      if self._stop_at(self.decode(self.tokens[:mid])) >= 0:
        hi = mid
      else:
        lo = mid + 1
    return lo
