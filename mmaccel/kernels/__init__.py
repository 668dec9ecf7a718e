"""mmaccel.kernels: the one attention-kernel layer every module shares."""
from .column_scores import attention_column_scores

__all__ = ["attention_column_scores"]
