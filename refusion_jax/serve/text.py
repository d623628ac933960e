"""Text that can no longer change, from a growing committed token prefix."""

from __future__ import annotations

from typing import Callable, Collection, Sequence


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
  character (U+FFFD from a cut multibyte sequence), the text of trailing
  `unsettled` tokens (byte-fallback tokens, whose text depends on the bytes that
  follow them: `Tokenizer.unsettled_ids`) and a suffix that might begin a stop
  string are held back. Once a stop string appears, the text ends before it,
  `stopped` is set, and `tokens` is cut to the fewest tokens whose text holds the
  stop string.

  With `incremental` (`Tokenizer.decodes_incrementally`: a decoder whose steps
  map each token to its text, with effects only at the first or last token of what
  it decodes), an update decodes a window instead of the whole prefix, as an
  incremental detokenizer does: the tokens since the last anchor, where the text
  ended in a whole character, and those before it since the anchor before (so the
  first-token effects cancel: a SentencePiece piece's leading space, a WordPiece
  word's). A stream of n tokens then costs O(n) decoding instead of O(n^2); the
  texts are the same (and where a window's text does not begin with its head's,
  which no listed decoder gives, the stream decodes the whole prefix again).
  """

  def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = (),
               incremental: bool = False, unsettled: Collection[int] = frozenset()):
    self.decode = decode
    self.stops = [s for s in stops if s]
    self._longest_stop = max(map(len, self.stops), default=1)
    self.incremental = incremental
    self.unsettled = unsettled
    self.sent = ""
    self.tokens: list[int] = []
    self.stopped = False
    # incremental: tokens[:_whole] decode to _whole_text, which ends in a whole
    # character; tokens[_from:_whole] decode to _head (_from the anchor before).
    self._from = self._whole = 0
    self._head = self._whole_text = ""

  def _stop_at(self, text: str, start: int = 0) -> int:
    found = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
    return min(found) if found else -1

  def _text(self) -> str:
    tokens = self.tokens
    if not self.incremental:
      return self.decode(tokens)
    tail = self.decode(tokens[self._from:])
    if not tail.startswith(self._head):
      self._from = self._whole = 0
      self._head = self._whole_text = ""
      tail = self.decode(tokens)
    text = self._whole_text + tail[len(self._head):]
    if len(tokens) > self._whole and not tail.endswith("\ufffd"):
      head = self.decode(tokens[self._whole:])
      # A window must begin with a token its head decodes (a skipped special token
      # is not decoded, so the token after it would take the first token's effects):
      # where the new tokens decode to nothing, the window keeps its start.
      if head:
        self._from, self._head = self._whole, head
      else:
        self._head = tail
      self._whole, self._whole_text = len(tokens), text
    return text

  def update(self, tokens: Sequence[int], final: bool = False) -> str:
    if self.stopped:
      return ""
    n = len(tokens)
    if not final:
      while n and tokens[n - 1] in self.unsettled:
        n -= 1
    self.tokens = list(tokens[:n])
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
