"""The KV-cache methods of :mod:`mmaccel.longctx` by name (:class:`mmaccel.specs.Registry`), filled by the package's
``__init__``; below every method module, so wrappers resolve nested specs without an import circle."""
from __future__ import annotations

from ..specs import Registry

REGISTRY = Registry('KV-cache method')
#: name -> class; the CLI and the app list it.
METHODS = REGISTRY.methods
#: spec -> a KV-cache method (:meth:`mmaccel.specs.Registry.build`).
build_method = REGISTRY.build
