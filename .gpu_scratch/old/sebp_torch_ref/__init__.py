"""PyTorch/Triton reference of SEBP (Sparsity-Exploiting Backward Pass).

The forward of a linear layer is unchanged; its backward runs on the rows of the output gradient
that a :class:`RowPolicy` keeps (DESIGN §2). Imports nothing from ``sebp_jax``.
"""

from .function import dense_backward, sebp_linear
from .patch import SEBPLinear, apply_sebp
from .plan import RowPlan, row_plan
from .policy import RowPolicy

__all__ = ["RowPlan", "RowPolicy", "SEBPLinear", "apply_sebp", "dense_backward", "row_plan", "sebp_linear"]
