"""The registry of :mod:`mmaccel.vision_tokens`: name -> class, filled once by the package's ``__init__``.

It sits below every method module, so a wrapper that takes a nested spec (resolved through :func:`build_method`) imports
this module and not its own package: no import circle. The CLI and the app list :data:`METHODS`.
"""
from __future__ import annotations

from ..specs import MethodSpec, build_from_registry

#: name -> visual-token method class; the package's ``__init__`` fills it (one line per method).
METHODS: dict[str, type] = {}


def build_method(spec: str | MethodSpec):
    """Build a visual-token method from a spec such as ``"name:key=value"``.

    Raises
    ------
    ValueError
        For an unknown name (the message lists :data:`METHODS`), an unknown argument, or a bad value.
    """
    return build_from_registry(spec, METHODS, 'visual-token method')
