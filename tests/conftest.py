"""Test configuration: offline hub, Triton interpreter on the CPU, a GPU marker."""
import gc
import os

# Must be set before any module that defines Triton kernels is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

_last_module = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """At each test module's first test (the previous module's fixtures are torn down by then): collect, then move
    what is still alive (torch, transformers, gradio, the test modules, modules imported on first use, session
    fixtures) out of the garbage collector's reach. ``PeakMemory`` calls ``gc.collect()`` on entry, which otherwise
    walks that whole heap (0.3 s each, hundreds of times a run). What the module makes afterwards, its models
    included, is collected as before."""
    if _last_module[-1:] != [item.module]:
        _last_module[:] = [item.module]
        gc.collect()
        gc.freeze()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Run a module on one torch thread and restore the setting after: tiny models gain nothing from 2 threads, and a
    busy neighbour stalls every multi-threaded op (platform notes). Use with ``pytest.mark.usefixtures``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The tiny random Llama of ``test_eval`` and its BPE tokenizer, saved as a local HF checkpoint folder."""
    from test_eval import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
