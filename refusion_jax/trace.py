"""Renders the decoding order recorded in `DecodeOutput.commit_step_bg`.

Two views of the same data (per response: token pieces and the loop step at
which each was committed):

* `ansi(...)`: the response with each token coloured by its commit step, for
  a terminal;
* `html(...)`: one self-contained page (inline CSS and JS, no external
  assets) with a step slider and a play button that reveals the tokens in
  the order they were decided.
"""

from __future__ import annotations

import html as html_lib
import json
from typing import Callable, Sequence

# 256-colour terminal codes from blue through green to red: early steps are cool.
_ANSI_RAMP = (21, 27, 33, 39, 45, 51, 50, 49, 48, 47, 46, 82, 118, 154, 190, 226, 220, 214,
              208, 202, 196)


def token_pieces(tokens: Sequence[int], decode_one: Callable[[list[int]], str] | None) -> list[str]:
  """The text of each token (its id in angle brackets when there is no tokenizer)."""
  if decode_one is None:
    return [f"<{int(t)}>" for t in tokens]
  return [decode_one([int(t)]) for t in tokens]


def _check(pieces: Sequence[str], steps: Sequence[int]) -> None:
  if len(pieces) != len(steps):
    raise ValueError(f"trace: {len(pieces)} token pieces but {len(steps)} commit steps")


def ansi(pieces: Sequence[str], steps: Sequence[int]) -> str:
  """The response with ANSI colours per commit step, and a legend line."""
  _check(pieces, steps)
  if not pieces:
    return "(empty response)"
  last = max(max(steps), 1)
  out = []
  for piece, step in zip(pieces, steps):
    if step < 0:
      out.append(f"\x1b[2m{piece}\x1b[0m")  # never committed: dim
      continue
    colour = _ANSI_RAMP[round(step / last * (len(_ANSI_RAMP) - 1))]
    out.append(f"\x1b[38;5;{colour}m{piece}\x1b[0m")
  legend = " ".join(
      f"\x1b[38;5;{_ANSI_RAMP[round(s / last * (len(_ANSI_RAMP) - 1))]}m{s}\x1b[0m"
      for s in sorted({s for s in steps if s >= 0}))
  return "".join(out) + f"\n  commit steps: {legend}"


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; background: #fafafa; }}
.item {{ margin-bottom: 2em; padding: 1em; background: #fff; border: 1px solid #ddd; }}
.prompt {{ color: #555; white-space: pre-wrap; font-family: monospace; margin-bottom: .5em; }}
.resp {{ white-space: pre-wrap; font-family: monospace; line-height: 1.8; }}
.tok {{ padding: 1px 0; border-radius: 3px; transition: opacity .2s; }}
.tok.hidden {{ opacity: .12; background: #ccc !important; }}
.meta {{ color: #777; font-size: 90%; margin-top: .5em; }}
#controls {{ position: sticky; top: 0; background: #fafafa; padding: .5em 0; }}
</style></head><body>
<h1>{title}</h1>
<div id="controls">step <input type="range" id="step" min="-1" max="{max_step}" value="{max_step}">
<span id="label">{max_step}</span> / {max_step}
<button id="play">play</button></div>
<div id="items"></div>
<script>
const DATA = {data};
const items = document.getElementById('items');
const spans = [];
function colour(step, last) {{
  const hue = 240 - 240 * (last > 0 ? step / last : 0);
  return 'hsl(' + hue + ', 80%, 82%)';
}}
for (const rec of DATA.records) {{
  const div = document.createElement('div'); div.className = 'item';
  const p = document.createElement('div'); p.className = 'prompt'; p.textContent = rec.prompt;
  const r = document.createElement('div'); r.className = 'resp';
  rec.pieces.forEach((piece, i) => {{
    const s = document.createElement('span'); s.className = 'tok';
    s.textContent = piece; s.dataset.step = rec.steps[i];
    s.title = 'step ' + rec.steps[i];
    s.style.background = rec.steps[i] < 0 ? '#eee' : colour(rec.steps[i], DATA.max_step);
    r.appendChild(s); spans.push(s);
  }});
  const m = document.createElement('div'); m.className = 'meta'; m.textContent = rec.meta;
  div.appendChild(p); div.appendChild(r); div.appendChild(m); items.appendChild(div);
}}
const slider = document.getElementById('step');
const label = document.getElementById('label');
function show(upto) {{
  label.textContent = upto;
  for (const s of spans) {{ s.classList.toggle('hidden', Number(s.dataset.step) > upto); }}
}}
slider.addEventListener('input', () => show(Number(slider.value)));
let timer = null;
document.getElementById('play').addEventListener('click', () => {{
  if (timer) {{ clearInterval(timer); timer = null; return; }}
  slider.value = -1; show(-1);
  timer = setInterval(() => {{
    const v = Number(slider.value) + 1;
    if (v > DATA.max_step) {{ clearInterval(timer); timer = null; return; }}
    slider.value = v; show(v);
  }}, 400);
}});
show(DATA.max_step);
</script></body></html>
"""


def html(records: Sequence[dict], title: str = "Decoding order") -> str:
  """A self-contained page; each record has "prompt", "pieces", "steps", "meta"."""
  clean = []
  for i, rec in enumerate(records):
    for key in ("prompt", "pieces", "steps", "meta"):
      if key not in rec:
        raise ValueError(f"trace.html: records[{i}] has no {key!r}")
    _check(rec["pieces"], rec["steps"])
    clean.append({"prompt": str(rec["prompt"]), "pieces": [str(p) for p in rec["pieces"]],
                  "steps": [int(s) for s in rec["steps"]], "meta": str(rec["meta"])})
  max_step = max([max(r["steps"], default=0) for r in clean] + [0])
  # "</" is escaped so that no token text can close the <script> element.
  data = json.dumps({"records": clean, "max_step": max_step}).replace("</", "<\\/")
  return _PAGE.format(title=html_lib.escape(title), max_step=max_step, data=data)
