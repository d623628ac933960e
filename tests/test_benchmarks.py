"""The benchmark scripts run and report well-formed rows (their numbers are not checked)."""

import pytest

from benchmarks import forward_cost


def test_forward_cost_reports_each_width(capsys):
  rows = forward_cost.main(["--widths=1,4", "--passes=2", "--repeats=1", "--context=8"])
  assert [r["width"] for r in rows] == [1, 4]
  assert all(r["ms_per_pass"] > 0 for r in rows)
  out = capsys.readouterr().out
  assert "| 1 |" in out and "| 4 |" in out and "1.00x" in out


@pytest.mark.parametrize("flag, needle", [("--widths=1,x", "comma-separated ints"),
                                          ("--widths=0,4", "must be positive"),
                                          ("--passes=0", "--passes must be >= 1")])
def test_forward_cost_rejects_bad_flags(flag, needle, capsys):
  with pytest.raises(SystemExit):
    forward_cost.parse_args([flag])
  assert needle in capsys.readouterr().err


def test_forward_cost_names_an_over_long_context():
  with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
    forward_cost.main(["--widths=4", "--context=100000", "--passes=1", "--repeats=1"])
