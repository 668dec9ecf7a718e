"""The composition layer: specs parsed once into typed methods, wrappers that take method objects (and refuse to
wrap themselves), compose() -> one Composition that Pipeline and generate_measured both run, and the layering
(mmaccel.pipeline never imports mmaccel.eval)."""
import grimp
import pytest
from tiny_models import random_prompt, tiny_llama

import mmaccel
import mmaccel.specs
from mmaccel.eval import generate_measured, measure_pipeline
from mmaccel.longctx import AdaKV, Chunked, ChunkKV, SnapKV, StreamingLLM
from mmaccel.longctx import build_method as build_kv
from mmaccel.pipeline import Composition, compose, resolve_kv
from mmaccel.specs import parse_method_spec

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2, vocab_size=128)


def _greedy(model, kv, n=6, length=40):
    return generate_measured(model, None, random_prompt(length), method=kv, max_new_tokens=n, warmup=0,
                             raise_errors=True).output_ids


# ------------------------------------------------------------------------------------------------ one dialect
@pytest.mark.parametrize("spec,key", [
    ("snapkv:budget=1:budget=2", "budget"),
    ("chunked:chunk=8:method=full:chunk=16", "chunk"),
    ("draft:model=micro-draft:k=4:k=2", "k"),
])
def test_a_duplicate_key_is_an_error_naming_the_key(spec, key):
    with pytest.raises(ValueError, match=rf"key '{key}' is given twice"):
        parse_method_spec(spec)
    with pytest.raises(ValueError, match=rf"key '{key}' is given twice"):
        mmaccel.compose(kv=spec) if not spec.startswith("draft") else mmaccel.compose(speculative=spec)


def test_a_duplicate_key_inside_a_nested_spec_is_an_error():
    with pytest.raises(ValueError, match=r"key 'budget' is given twice"):
        build_kv("chunkkv:method=snapkv,budget=8,budget=16")


def test_specs_that_work_today_still_parse():
    assert parse_method_spec("chunked:chunk=1024:method=streaming,window=2048").kwargs == {
        "chunk": 1024, "method": "streaming,window=2048"}
    assert parse_method_spec("tree:model=micro-draft:shape=3,2,2").kwargs["shape"] == "3,2,2"
    chunked = build_kv("chunked:chunk=1024:method=streaming,window=2048")
    assert isinstance(chunked.method, StreamingLLM) and chunked.method.window == 2048 and chunked.chunk == 1024


@pytest.mark.parametrize("make", [
    lambda: build_kv("chunked:chunk=8:method=chunked,chunk=4"),
    lambda: Chunked(Chunked(SnapKV(budget=16, window=4), chunk=4), chunk=8),
    lambda: build_kv("chunkkv:method=chunkkv,chunk=4"),
    lambda: ChunkKV(ChunkKV(SnapKV(budget=16, window=4))),
    lambda: AdaKV(AdaKV(SnapKV(budget=16, window=4))),
])
def test_a_wrapper_that_wraps_itself_is_refused(make):
    with pytest.raises(ValueError, match=r"(chunked|chunkkv|adakv) cannot wrap itself"):
        make()


# ------------------------------------------------------------------------------------------------ typed wrappers
@pytest.mark.parametrize("typed,spec", [
    (lambda: ChunkKV(SnapKV(budget=16, window=4), chunk=4), "chunkkv:method=snapkv,budget=16,window=4:chunk=4"),
    (lambda: AdaKV(SnapKV(budget=16, window=4)), "adakv:method=snapkv,budget=16,window=4"),
    (lambda: Chunked(SnapKV(budget=16, window=4), chunk=8), "chunked:chunk=8:method=snapkv,budget=16,window=4"),
])
def test_typed_wrappers_equal_their_spec_form(model, typed, spec):
    obj, from_spec = typed(), build_kv(spec)
    assert obj == from_spec and obj.spec == from_spec.spec
    assert isinstance(obj.method, SnapKV) and obj.method == from_spec.method
    out = _greedy(model, obj)
    assert out == _greedy(model, spec) and len(out) == 6


def test_the_spec_form_of_a_typed_wrapper_rebuilds_it():
    obj = ChunkKV(SnapKV(ratio=0.25))
    assert build_kv(obj.spec) == obj


# ------------------------------------------------------------------------------------------------ parsed once
@pytest.fixture
def parses(monkeypatch):
    """Every parse of a spec's text (``mmaccel.specs._parse_text``), by text."""
    seen = []
    real = mmaccel.specs._parse_text

    def counting(text):
        seen.append(text)
        return real(text)

    monkeypatch.setattr(mmaccel.specs, "_parse_text", counting)
    return seen


def test_a_spec_is_parsed_once_through_generate_measured(model, parses):
    kv, spec = "snapkv:budget=16:window=4", "prompt_lookup:k=4"
    rec = generate_measured(model, None, random_prompt(40), method=spec, kv=kv, max_new_tokens=4, warmup=1,
                            repeats=2, raise_errors=True)
    assert rec.ok and rec.method == f"{kv} + {spec}"
    assert sorted(parses) == sorted([kv, spec])
    parses.clear()
    rec = generate_measured(model, None, random_prompt(40), method=kv, max_new_tokens=4, warmup=0)
    assert rec.ok and parses == [kv]


def test_a_pipeline_parses_at_construction_only(model, parses):
    pipe = mmaccel.Pipeline(model, None, kv="chunkkv:method=snapkv,budget=16,window=4:chunk=4",
                            speculative="prompt_lookup")
    assert parses == ["chunkkv:method=snapkv,budget=16,window=4:chunk=4", "snapkv:budget=16:window=4",
                      "prompt_lookup"]  # the nested spec once, by the wrapper
    parses.clear()
    gen = pipe.generate(random_prompt(40), max_new_tokens=4)
    rec = measure_pipeline(pipe, random_prompt(40), max_new_tokens=4)
    assert parses == [] and gen.output_ids == rec.output_ids


# ------------------------------------------------------------------------------------------------ compose
def test_compose_returns_one_typed_composition(model):
    composed = compose(kv=ChunkKV(SnapKV(ratio=0.25)), speculative="prompt_lookup", model=model)
    assert isinstance(composed, Composition) and isinstance(composed.kv, ChunkKV)
    assert composed.method is composed.speculative and composed.engine_kv is composed.kv
    assert composed.label == "kv=chunkkv + speculative=prompt_lookup"
    plain = compose()
    assert plain.label == "plain" and plain.method.name == "full" and plain.engine_kv is None
    # generate_measured runs a Composition as it is; it refuses one given with more pieces
    rec = generate_measured(model, None, random_prompt(40), method=compose(kv="snapkv:budget=16:window=4"),
                            max_new_tokens=4, warmup=0)
    assert rec.ok and rec.method == "snapkv:budget=16:window=4" and rec.method_name == "snapkv"
    with pytest.raises(ValueError, match="a Composition already holds its vision and kv methods"):
        generate_measured(model, None, random_prompt(40), method=plain, kv="full")


def test_compose_refuses_before_anything_runs(model):
    with pytest.raises(ValueError, match=r"kv='h2o' conflicts with speculative='prompt_lookup'"):
        compose(kv="h2o:budget=64", speculative="prompt_lookup", model=model)
    with pytest.raises(ValueError, match=r"'prompt_lookup' is a speculative method: pass it as speculative="):
        compose(kv="prompt_lookup")
    with pytest.raises(ValueError, match=r"kv='snapkv' and the KV method 'streaming' both set the cache"):
        generate_measured(model, None, random_prompt(8), method="streaming:window=4", kv="snapkv:budget=4:window=4")


def test_resolution_passes_objects_through():
    method = SnapKV(budget=8, window=4)
    assert resolve_kv(method) == (method, "snapkv")


# ------------------------------------------------------------------------------------------------ layering
def test_the_composition_layer_imports_no_measurement():
    graph = grimp.build_graph("mmaccel")
    below = graph.find_descendants("mmaccel.pipeline") | {"mmaccel.pipeline"}
    up = [(m, i) for m in below for i in graph.find_modules_directly_imported_by(m) if i.startswith("mmaccel.eval")]
    assert up == []
    assert graph.find_shortest_chain(importer="mmaccel.pipeline", imported="mmaccel.eval") is None
    assert graph.direct_import_exists(importer="mmaccel.eval.generation", imported="mmaccel.pipeline")
