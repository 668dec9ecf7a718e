"""The visual-token methods of :mod:`mmaccel.vision_tokens` by name (:class:`mmaccel.specs.Registry`), filled by the package's
``__init__``; below every method module, so wrappers resolve nested specs without an import circle."""
from __future__ import annotations

from ..specs import Registry

REGISTRY = Registry('visual-token method')
#: name -> class; the CLI and the app list it.
METHODS = REGISTRY.methods
#: spec -> a visual-token method (:meth:`mmaccel.specs.Registry.build`).
build_method = REGISTRY.build
