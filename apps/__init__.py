"""mmaccel.apps: the mmaccel Gradio workbench (``mmaccel app`` or ``python -m mmaccel.apps.workbench``).

The repository keeps it in its top-level ``apps/`` folder; setuptools installs that folder as ``mmaccel.apps``
(``package-dir`` in pyproject.toml), so a plain ``pip install .`` ships it. See :mod:`mmaccel.apps.workbench` and
:mod:`mmaccel.apps.forms`.
"""
