"""mmaccel.models: model loading and the offline micro-model zoo."""
from .loading import ModelLoadError, load, resolve_model_path
from .zoo import ZOO, list_models, zoo_path

__all__ = ["load", "resolve_model_path", "ModelLoadError", "ZOO", "list_models", "zoo_path"]
