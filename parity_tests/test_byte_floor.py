"""``benchmarks.byte_floor``: the bytes an SEBP backward must move, counted by hand."""

from __future__ import annotations

import pytest

from benchmarks import byte_floor
from benchmarks.byte_floor import Projection, floor_bytes
from sebp_jax.models.bert import BertConfig
from sebp_jax.models.llama import LlamaConfig


def test_counts_by_hand():
  # Two siblings of one input share one dX; a biased layer's dy is read by its bias gradient,
  # so the bound's read of it is no saving; a per-sequence layer has one row per sequence.
  projections = [Projection("q", 4, 8, count=2, group="qk"), Projection("k", 4, 2, count=2,
                                                                          group="qk"),
                 Projection("o", 8, 4, count=2, bias=True),
                 Projection("pool", 4, 4, rows="sequences")]
  got = floor_bytes(projections, batch=3, seq_len=5, itemsize=2)
  weights = 2 * (2 * 4 * 8 + 2 * 4 * 2 + 2 * 8 * 4 + 4 * 4)
  dx = 2 * (2 * 15 * 4 + 2 * 15 * 8 + 3 * 4)
  assert got == {"weights": weights, "dw": weights, "dx": dx, "sebp": 2 * weights + dx,
                 "bound_dy": 2 * (2 * 15 * 8 + 2 * 15 * 2 + 3 * 4)}


def test_llama_3_2_3b_b1():
  # The numbers of benchmarks/NOTES.md, "v17": 6.43 GB of weights (the tied head's 0.79 GB
  # among them), 4.02 GB of dX, 7.39 GB of dy the bound reads.
  got = floor_bytes(byte_floor.llama_projections(LlamaConfig.llama_3_2_3b()), batch=1,
                    seq_len=4096)
  assert got["weights"] == 2 * (28 * (2 * 3072 * 3072 + 2 * 3072 * 1024 + 3 * 3072 * 8192)
                                + 3072 * 128256)
  assert got["dx"] == 2 * 4096 * (28 * (3 * 3072 + 8192) + 3072)
  assert round(got["sebp"] / 1e9, 2) == 16.87 and round(got["bound_dy"] / 1e9, 2) == 7.39


def test_planned_dx_is_whole_only_before_the_attention_backward():
  # v20: under a plan a dX is written whole only where the attention backward reads it (o's);
  # the q/k/v, gate/up and down dX are their kept rows, the tied head's too.
  config = LlamaConfig.llama_3_2_3b()
  projections = byte_floor.llama_projections(config)
  whole = floor_bytes(projections, batch=1, seq_len=4096)
  none_kept = floor_bytes(projections, batch=1, seq_len=4096, planned_dx=True)
  assert none_kept["dx"] == 2 * 4096 * 28 * 3072  # o's alone
  assert none_kept["weights"] == whole["weights"]
  tenth = floor_bytes(projections, batch=1, seq_len=4096, planned_dx=True, kept=0.1)
  others = whole["dx"] - none_kept["dx"]
  assert tenth["dx"] == pytest.approx(none_kept["dx"] + 0.1 * others, abs=4)  # rounded per group
  everything = floor_bytes(projections, batch=1, seq_len=4096, planned_dx=True, kept=1.0)
  assert everything == whole


def test_bert_reads_dy_for_its_biases():
  got = floor_bytes(byte_floor.bert_projections(BertConfig()), batch=32, seq_len=512)
  assert got["bound_dy"] == 0


def test_markdown_gives_the_floor_and_the_ratio():
  counted = {"weights": 1e9, "dw": 1e9, "dx": 1e9, "sebp": 3e9, "bound_dy": 1e9}
  text = byte_floor.markdown("toy", counted, dense_ms=20.0, bound_ms=5.0, bandwidths_tb_s=(1.0,))
  # 3 GB at 1 TB/s: 3 ms; 1 GB of dy: 1 ms; floor 5 - 1 + 3 = 7 ms; 20 / 7 = 2.86x.
  assert "| 1.00 TB/s | 3.00 | 1.00 | 7.00 | 2.86× |" in text
  assert "| – | – |" in byte_floor.markdown("toy", counted, bandwidths_tb_s=(1.0,))


@pytest.mark.parametrize("model", ["llama", "bert"])
def test_cli(model, capsys):
  text = byte_floor.main(["--model", model, "--batch", "2", "--dense-ms", "50", "--bound-ms",
                          "20"])
  assert text in capsys.readouterr().out and "× |" in text


def test_cli_planned_dx_lowers_the_floor_and_checks_kept():
  plain = byte_floor.main(["--model", "llama", "--batch", "1", "--dense-ms", "84.7",
                           "--bound-ms", "19.63"])
  planned = byte_floor.main(["--model", "llama", "--batch", "1", "--dense-ms", "84.7",
                             "--bound-ms", "19.63", "--planned-dx", "--kept", "0.021"])
  assert plain != planned
  with pytest.raises(SystemExit):
    byte_floor.main(["--model", "llama", "--batch", "1", "--planned-dx", "--kept", "2"])
