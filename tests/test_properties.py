"""Property-based tests (Hypothesis) of what every user string and number goes through: the method-spec parser, the
three registries' builders, and the budget and keep-ratio arithmetic. Any input gives a result or one clear
``ValueError``, never another exception (issue 33).

Reproducible in CI: a ``derandomize=True`` profile (the examples follow from the test, not from a seed drawn at run
time), a bounded ``max_examples`` and no deadline (the CI machine is shared and slow).
"""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmaccel.longctx
import mmaccel.speculative
import mmaccel.vision_tokens  # noqa: F401
from mmaccel.longctx.base import KVScorer
from mmaccel.longctx.registry import METHODS as KV_METHODS
from mmaccel.longctx.registry import build_method as build_kv
from mmaccel.specs import MethodSpec, accepted_keys, parse_method_spec
from mmaccel.speculative.registry import METHODS as DRAFTERS
from mmaccel.speculative.registry import build_drafter
from mmaccel.vision_tokens import check_keep_ratio, kept_count
from mmaccel.vision_tokens.registry import METHODS as VISION_METHODS
from mmaccel.vision_tokens.registry import build_method as build_vision

settings.register_profile("mmaccel-ci", derandomize=True, deadline=None, max_examples=80, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("mmaccel-ci")

# Values a user may type after "key=": numbers of every kind (NaN, infinities, huge), words, lists, nested specs.
_WORDS = ["0", "-1", "1", "2", "0.5", "1.5", "nan", "inf", "-inf", "1e309", "1e-300", "99999999999999999999", "true",
          "false", "none", "null", "abc", "", "3,2,2", "2,8", "-1,2", "0.5,0.25", "snapkv", "full", "fastv",
          "snapkv,budget=8", "draft", "chunked,chunk=8", "=", ",", "::", "é", "\x00"]
_VALUES = st.one_of(
    st.sampled_from(_WORDS),
    st.integers(min_value=-10**20, max_value=10**20).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12),
)


def _spec_of(registry: dict):
    """Specs ``name:key=value...`` over a registry's names and each method's own keys (plus a few unknown ones)."""

    @st.composite
    def spec(draw):
        name = draw(st.sampled_from(sorted(registry)))
        keys = (accepted_keys(registry[name]) or []) + ["bogus"]
        chosen = draw(st.lists(st.sampled_from(keys), max_size=3, unique=True))
        return name + "".join(f":{key}={draw(_VALUES)}" for key in chosen)

    return spec()


def _result_or_value_error(fn, *args):
    try:
        return fn(*args)
    except ValueError as exc:
        assert str(exc).strip(), "a ValueError must say what is wrong"
        assert "\n" not in str(exc).strip(), f"one line, got {str(exc)!r}"
        return None


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",))))
def test_parse_method_spec_any_text(text):
    spec = _result_or_value_error(parse_method_spec, text)
    if spec is not None:
        assert isinstance(spec, MethodSpec) and spec.name == spec.name.lower()
        assert parse_method_spec(spec) is spec  # parsed once
        assert parse_method_spec(spec.text) == spec  # the stored text parses back to the same spec


@given(st.sampled_from(["snapkv", "streaming", "x"]), st.dictionaries(
    st.text(alphabet="abcdefghij_", min_size=1, max_size=6), _VALUES.map(lambda v: v.replace(":", "")), max_size=4))
def test_parse_method_spec_round_trips_keys(name, kwargs):
    text = name + "".join(f":{k}={v}" for k, v in kwargs.items())
    spec = parse_method_spec(text)
    assert spec.name == name and list(spec.kwargs) == list(kwargs)
    for key, raw in kwargs.items():
        value = spec.kwargs[key]
        if isinstance(value, float) and math.isnan(value):
            assert raw.strip().lower() in ("nan", "+nan", "-nan")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            assert value == type(value)(raw.strip())


@pytest.mark.parametrize("registry,build", [(KV_METHODS, build_kv), (VISION_METHODS, build_vision),
                                            (DRAFTERS, build_drafter)], ids=["longctx", "vision_tokens", "speculative"])
def test_build_any_spec_gives_a_method_or_value_error(registry, build):
    @given(_spec_of(registry))
    @settings(max_examples=150)
    def check(text):
        method = _result_or_value_error(build, text)
        if method is not None:
            assert type(method) in registry.values() or hasattr(method, "spec") or hasattr(method, "name")

    check()


@given(st.text(max_size=30))
@settings(max_examples=40)
def test_build_unknown_text_is_value_error(text):
    for build in (build_kv, build_vision, build_drafter):
        _result_or_value_error(build, text)


# ------------------------------------------------------------------------------------------------ the arithmetic
_NUMBERS = st.one_of(st.integers(min_value=-10**12, max_value=10**12), st.floats(allow_nan=True, allow_infinity=True),
                     st.booleans(), st.none(), st.text(max_size=4))
_SCORERS = sorted(n for n, cls in KV_METHODS.items() if issubclass(cls, KVScorer))


@given(st.sampled_from(_SCORERS), _NUMBERS, _NUMBERS, st.integers(min_value=0, max_value=10**9))
def test_kv_budget_resolution(name, budget, ratio, seen):
    """``budget``/``ratio`` of every scorer: built, or a ValueError; a built one keeps 1 <= slots, and a ratio keeps
    ``ceil(ratio * seen)`` (never more than the context)."""
    cls = KV_METHODS[name]
    kwargs = {k: v for k, v in (("budget", budget), ("ratio", ratio)) if v is not None}
    method = _result_or_value_error(lambda: cls(**kwargs))
    if method is None:
        return
    keep = method.context_budget(seen)
    assert isinstance(keep, int) and keep >= 1
    if method.ratio is not None:
        assert 0 < method.ratio <= 1 and keep == max(1, math.ceil(method.ratio * seen)) and keep <= max(seen, 1)
    else:
        assert keep == method.budget


@given(st.integers(min_value=-5, max_value=10**7), _NUMBERS)
def test_kept_count(n, keep_ratio):
    """Visual tokens kept of ``n`` at ``keep_ratio``: a ValueError for a bad ratio or count, else 0 <= kept <= n,
    at least one of a non-empty set, all at 1.0, and close to ``keep_ratio * n``."""
    kept = _result_or_value_error(kept_count, n, keep_ratio)
    if kept is None:
        if n >= 0:
            with pytest.raises(ValueError):
                check_keep_ratio(keep_ratio)
        return
    assert 0 <= kept <= n and (kept >= 1 or n == 0)
    assert kept == n if keep_ratio == 1 else abs(kept - keep_ratio * n) <= max(1.0, 0.5 + 1e-9 * n)


@given(st.sampled_from(sorted(n for n, cls in VISION_METHODS.items() if "keep_ratio" in (accepted_keys(cls) or []))),
       _NUMBERS)
def test_vision_keep_ratio(name, keep_ratio):
    """Every visual-token method's ``keep_ratio``: built with a float in (0, 1], or a ValueError."""
    method = _result_or_value_error(lambda: VISION_METHODS[name](keep_ratio=keep_ratio))
    if method is not None:
        assert 0 < method.keep_ratio <= 1


@pytest.mark.parametrize("spec", ["progressive:layers=-inf", "progressive:layers=inf", "progressive:layers=1e309",
                                  "progressive:keep_ratios=nan", "pooling:keep_ratio=nan", "tome:r=inf"])
def test_found_vision_specs_are_value_errors(spec):
    """What the properties found (progressive's layers=inf raised OverflowError), kept as plain regressions."""
    with pytest.raises(ValueError):
        build_vision(spec)


def test_kept_count_of_nothing_is_nothing():
    assert kept_count(0, 0.5) == 0 and kept_count(0, 1.0) == 0  # was 1 of 0 before the property found it
