"""The workbench's tabs, one module each; :data:`TABS` lists them in display order.

Each tab is a :class:`mmaccel.apps.common.Tab`: its endpoint handlers are methods (callable directly from tests and
scripts), and ``build(model)`` lays it out inside the current ``gr.Tab`` and wires its endpoints.

| tab | module | endpoints |
|---|---|---|
| Long context | :mod:`mmaccel.apps.tabs.longctx` | ``/longctx``, ``/niah_document`` |
| Generation | :mod:`mmaccel.apps.tabs.generation` | ``/generation`` |
| Evaluations | :mod:`mmaccel.apps.tabs.evaluations` | ``/niah_eval`` |
| Vision sweep | :mod:`mmaccel.apps.tabs.vision_sweep` | ``/vision_sweep`` |
| Spec bench | :mod:`mmaccel.apps.tabs.specbench` | ``/spec_bench`` |
| Kernels | :mod:`mmaccel.apps.tabs.kernels` | ``/kernels`` |
| Image & video QA | :mod:`mmaccel.apps.tabs.vlm_qa` | ``/vlm_qa`` |
| Image & video generation | :mod:`mmaccel.apps.tabs.ar_generation` | ``/ar_generation`` |
| Vision encoder | :mod:`mmaccel.apps.tabs.vision` | ``/vision`` |
"""
from .ar_generation import ARGenerationTab
from .evaluations import EvaluationsTab
from .generation import GenerationTab
from .kernels import KernelsTab
from .longctx import LongContextTab
from .specbench import SpecBenchTab
from .vision import VisionTab
from .vision_sweep import VisionSweepTab
from .vlm_qa import VLMQATab

TABS = (LongContextTab, GenerationTab, VLMQATab, ARGenerationTab, EvaluationsTab, VisionSweepTab, SpecBenchTab,
        KernelsTab, VisionTab)
"""Tab classes in display order."""

__all__ = ["TABS", "ARGenerationTab", "EvaluationsTab", "GenerationTab", "KernelsTab", "LongContextTab", "SpecBenchTab",
           "VLMQATab", "VisionSweepTab", "VisionTab"]
