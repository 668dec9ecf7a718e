"""apps: the mmaccel Gradio workbench (``python -m apps.workbench``); see :mod:`apps.workbench` and :mod:`apps.forms`."""
