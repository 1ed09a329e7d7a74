"""SEBP for JAX: the Sparsity-Exploiting Backward Pass for linear layers.

When short sequences are padded to a fixed context, most rows of a linear layer's output gradient
are zero; SEBP runs the backward matmuls on the active rows only. See ``RowPolicy`` for which rows
are kept and ``sebp_matmul`` for the contract.
"""

from sebp_jax.batch_crossover import above_crossover, sebp_value_and_grad
from sebp_jax.linen import SEBPDense, SEBPDenseGeneral, SEBPEinsum, dense_siblings, swap_dense
from sebp_jax.matmul import sebp_matmul, sebp_matmuls
from sebp_jax.plan import RowPlan, row_plan
from sebp_jax.policy import RowPolicy
from sebp_jax.sharding import sharded_rows

__all__ = ["RowPolicy", "RowPlan", "row_plan", "sebp_matmul", "sebp_matmuls", "SEBPDense",
           "SEBPDenseGeneral", "SEBPEinsum", "swap_dense", "dense_siblings", "sebp_value_and_grad",
           "above_crossover", "sharded_rows"]
