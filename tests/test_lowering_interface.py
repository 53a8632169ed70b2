"""The lowering interface: the registry, the runtime policy over it, the typed options."""

import dataclasses
import re

import pytest

import gdn_export
from gdn_export.ops.gated_delta_rule.nnef import policy, registry
from gdn_export.ops.gated_delta_rule.nnef.options import GatedDeltaRuleOptions, validate_options
from gdn_export.ops.options import NnefOptions



def test_every_registered_lowering_has_the_interface():
    assert registry.LOWERINGS == ("auto", "native", "scan", "recurrent", "chunked")
    for name, lowering in registry.registry().items():
        assert lowering.name == lowering.module.NAME == name
        assert callable(lowering.refusal) and callable(lowering.note) and callable(lowering.lower)
    assert registry.get("native").label == "fused op" and registry.get("chunked").label == "chunked"
    assert [name for name, lowering in registry.registry().items() if lowering.always_exact] == ["scan", "recurrent"]


def test_a_lowering_module_needs_a_name_a_refusal_and_a_lower():
    import types

    module = types.ModuleType("gdn_export.ops.gated_delta_rule.nnef.half_done")
    module.NAME, module.lower = "half_done", lambda builder, node, dims, options: []
    with pytest.raises(TypeError, match="half_done is registered as a lowering but has no refusal"):
        registry.Lowering.of(module)
    module.refusal = lambda node, dims, options: None
    lowering = registry.Lowering.of(module)
    assert (lowering.label, lowering.always_exact, lowering.note(None, None, None)) == ("half_done", False, "")


def test_the_emitter_and_export_see_the_registry():
    from gdn_export.ops.gated_delta_rule.nnef.emitter import LOWERINGS

    assert LOWERINGS is registry.LOWERINGS


def test_every_runtime_orders_registered_lowerings_and_ends_with_one_that_always_applies():
    assert policy.RUNTIMES == ("any", "cpu", "cuda") == tuple(policy.ORDER)  # an order for every NNEF runtime
    for runtime in policy.RUNTIMES:
        order = policy.candidates(runtime)
        assert set(order) <= set(registry.registry()), runtime
        assert registry.get(order[-1]).always_exact, runtime  # "no lowering fits" cannot happen


def test_options_are_frozen_with_defaults():
    options = GatedDeltaRuleOptions(tract_version=(0, 23, 9))
    assert (options.lowering, options.runtime, options.core_dtype, options.chunk_size, options.seq_may_vary) == (
        "auto", "any", None, None, False)
    assert not options.core_f16 and GatedDeltaRuleOptions(tract_version=(0, 23, 9), core_dtype="float16").core_f16
    assert GatedDeltaRuleOptions.of(NnefOptions(tract_version=(0, 23, 9))) == options  # a plan naming none of its own
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.lowering = "scan"


@pytest.mark.parametrize("values,message", [
    ({"lowering": "fast"}, "lowering 'fast' is not one of auto, native, scan, recurrent, chunked"),
    ({"runtime": "tpu"}, "runtime 'tpu' is not one of any, cpu, cuda"),
    ({"core_dtype": "bfloat16"}, "core_dtype 'bfloat16': only 'float16' (or None, the model's own) is supported"),
    ({"chunk_size": 24}, "chunk_size: a chunk size must be a positive multiple of 16 tokens, got 24"),
    ({"chunk_size": 0}, "chunk_size: a chunk size must be a positive multiple of 16 tokens, got 0"),
])
def test_option_values_are_validated_where_the_options_are_made(values, message):
    with pytest.raises(gdn_export.LoweringError) as raised:
        validate_options(**values)
    assert str(raised.value) == message
    positional = [values.get(name, default) for name, default in
                  (("lowering", "auto"), ("runtime", "any"), ("core_dtype", None), ("chunk_size", None))]
    with pytest.raises(gdn_export.LoweringError, match=re.escape(message)):
        validate_options(*positional)  # as export.py and hf/convert.py call it
    with pytest.raises(gdn_export.LoweringError) as raised:
        GatedDeltaRuleOptions(tract_version=(0, 23, 9), **values)
    assert str(raised.value) == message


def test_the_offline_target_carries_the_options():
    from gdn_export.pipeline.export import nnef_target

    target = nnef_target("0.23.7", lowering="chunked", dynamic_axes={"q": {1: "S"}}, runtime="cpu",
                         core_dtype="float16", chunk_size=32)
    assert target.gdn_options == NnefOptions(tract_version=(0, 23, 7), runtime="cpu", seq_may_vary=True, ops={
        "gated_delta_rule": {"lowering": "chunked", "core_dtype": "float16", "chunk_size": 32, "tail_chunk": None}})
    assert GatedDeltaRuleOptions.of(target.gdn_options) == GatedDeltaRuleOptions(
        tract_version=(0, 23, 7), lowering="chunked", runtime="cpu", core_dtype="float16", chunk_size=32,
        seq_may_vary=True)
    assert target.gdn_decisions == []
    assert not target.with_dynamic_axes({}).gdn_options.seq_may_vary
    with pytest.raises(gdn_export.LoweringError, match="runtime 'tpu'"):
        nnef_target("0.23.9", runtime="tpu")


def test_a_plain_torch_to_nnef_target_gets_the_defaults():
    from torch_to_nnef.inference_target.tract import TractNNEF

    from gdn_export.backends.compat import patched
    from gdn_export.backends.compat.torch_to_nnef import no_download
    from gdn_export.backends.nnef.target import _NoBinary
    from gdn_export.ops.options import policy_of

    with patched(no_download(_NoBinary)):
        plain = TractNNEF("0.23.9", check_io=False, dynamic_axes={"q": {1: "S"}})
    assert policy_of(plain) is plain
    assert plain.gdn_options == NnefOptions(tract_version=(0, 23, 9), seq_may_vary=True)
    decisions = plain.gdn_decisions
    assert policy_of(plain).gdn_decisions is decisions  # given once


# the one-way layering is checked transitively in tests/test_layering.py
