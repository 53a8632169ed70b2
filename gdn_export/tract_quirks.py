"""Every behaviour of tract (and of torch-to-nnef) that gdn_export works around or relies on, in one place.

Each entry says what the library does, what gdn_export does about it, which module applies that, and the
version it was seen on. ``canary`` names the test in ``tests/test_tract_quirks.py`` that rebuilds the
smallest graph showing the behaviour on the installed tract: it fails the day the behaviour changes, and its
message says which workaround can then go (``when_fixed``). Entries without a canary say why (``no_canary``):
a speed effect that only a timing shows, a GPU-only failure, or a comment that could not be reproduced in a
minimal graph (``reproduced=False``: the workaround is still carried, its reason is unconfirmed).

docs/TRACT.md explains the same facts in prose, with the measurements behind them.
"""

from __future__ import annotations

from dataclasses import dataclass

SEEN_ON = "0.23.9"
CHUNKED = "gdn_export/ops/gated_delta_rule/nnef/chunked/"  # the chunked lowering's package
TORCH_TO_NNEF_SEEN_ON = "0.24.12"


@dataclass(frozen=True)
class Quirk:
    """One library behaviour gdn_export has to know about."""

    name: str
    does: str  # what the library does
    workaround: str  # what gdn_export does about it
    applied_in: tuple[str, ...]  # modules carrying the workaround (or the reliance)
    when_fixed: str  # what can change once the behaviour is gone
    canary: str | None = None  # test function in tests/test_tract_quirks.py, or "test_compat.py::test_x"
    no_canary: str | None = None  # why there is no canary
    seen_on: str = SEEN_ON
    library: str = "tract"
    reproduced: bool = True  # False: stated by a comment, not reproduced in a minimal graph on seen_on
    # (kind "measured": a timing from benchmarks/, not re-run with the canaries)
    kind: str = "workaround"  # "workaround", "reliance" (behaviour the code depends on), "measured" (speed)


# --- output names ------------------------------------------------------------------------------------
OUTPUT_NAMED_AFTER_PRODUCER = Quirk(
    name="output named after its producer",
    does="Model.output_name reports the node that computes an output, not the NNEF name it is declared under: "
         "'y = copy(t)' reports 't' (declutter removes the copy), 'y = linear(...)' reports 'y_linear_output', "
         "'y = add(x, x)' reports 'y_1'.",
    workaround="after writing the graph, every output tract would rename is re-declared as "
               "'NAME = select(NAME__c, NAME__raw, NAME__raw)' (one copy of that output per call); which ones, "
               "output_names.renamed_outputs learns from a load of the first layers' cut of the graph (an output of "
               "an op outside MAY_KEEP_THEIR_NAME is wrapped unasked)",
    applied_in=("gdn_export/backends/nnef/output_names.py", "gdn_export/backends/nnef/exporter.py"),
    when_fixed="output_names.keep_output_names and the select wrappers can go",
    canary="test_output_named_after_producer",
)

SELECT_KEEPS_ITS_NAME = Quirk(
    name="a data-dependent select is never folded",
    does="'y = select(c, x, x)' with c computed from the data stays a node named 'y' (tract does not see that "
         "both branches are equal), so Model.output_name reports 'y'.",
    workaround="this is what the renaming workaround relies on",
    applied_in=("gdn_export/backends/nnef/output_names.py",),
    when_fixed="if tract starts folding it, output_names.keep_output_names fails loudly (GdnExportError) and "
               "needs another wrapper",
    canary="test_select_keeps_its_name",
    kind="reliance",
)

FUSED_OUTPUTS_SHARE_A_NAME = Quirk(
    name="a two-output fused op reports both outputs under its first name",
    does="'(y, st) = tract_transformers_causal_conv1d_update(...)' (or tract_transformers_gdn_recurrent) "
         "written straight into the graph outputs reports ['y', 'y']; a 'copy' after it is removed and "
         "reports the op's name again.",
    workaround="keep_output_names wraps the second output; fused.py and conv.py also route each output "
               "through one more op (a cast, or a copy when the dtype already matches, which tract removes: "
               "the wrapper does the work)",
    applied_in=("gdn_export/backends/nnef/output_names.py", "gdn_export/ops/gated_delta_rule/nnef/fused.py", "gdn_export/ops/causal_conv1d/nnef.py"),
    when_fixed="the extra op after the fused ops and the wrappers on their outputs can go",
    canary="test_fused_outputs_share_a_name",
)

SAME_TYPE_CAST_REMOVED = Quirk(
    name="a cast to the type its input has is removed, one that changes the type keeps its name",
    does="'y = tract_core_cast(t, to = \'f32\')' of an f32 t reports 't' (the loader drops the cast); 'y = "
         "tract_core_cast(t, to = \'f16\')' reports 'y'.",
    workaround="output_names.renamed_outputs decides an output computed by a cast from its types (the translated "
               "graph's: exporter.py passes the casts that change the type), without loading the graph: the MTP "
               "'hidden' output is computed after the last layer, where a load would be of the whole graph",
    applied_in=("gdn_export/backends/nnef/output_names.py", "gdn_export/backends/nnef/exporter.py"),
    when_fixed="if tract keeps a same-type cast's name, its output gets a select it does not need (a copy); if it "
               "renames a type-changing one, export's check fails with the names tract reports",
    canary="test_same_type_cast_removed",
    kind="reliance",
)

SELECT_BROADCAST_SLOW = Quirk(
    name="a select whose condition broadcasts copies slowly",
    does="'y = select(c, x, x)' over x [4, 6144, 4] f32 took 0.57 ms with c of shape [1, 1, 1] (from a slice and "
         "a reduction of x) against 0.11 ms with c = eq(x, x), of x's own shape; over [4, 1, 32000] the two "
         "were alike (0.13 and 0.14 ms): the broadcast path pays per run of the innermost axis",
    workaround="the renaming select's condition is eq(NAME__raw, NAME__raw) (the output itself for bool): same "
               "shape, still computed from the data, so still never folded",
    applied_in=("gdn_export/backends/nnef/output_names.py",),
    when_fixed="nothing to remove",
    no_canary="a speed effect (benchmarks/bench_serving_graph.py: a B = 4 decode step of the 580M serving graph)",
    kind="measured",
)

SUM_REDUCE_EMPTY_AXIS_ABORTS = Quirk(
    name="sum_reduce over an empty innermost axis aborts the process",
    does="sum_reduce over a zero-length last axis panics ('attempt to divide by zero', "
         "core/src/ops/nn/reduce.rs:261) across the FFI: the process aborts (SIGABRT), no Python exception. "
         "An empty axis that is not the last one (e.g. [1, 0, 1] over axis 1) is fine; max_reduce is fine.",
    workaround="no graph gdn_export writes reduces over a possibly empty axis (the renaming select's condition, "
               "which once reduced an output's symbolic axes with max_reduce, is elementwise since "
               "SELECT_BROADCAST_SLOW)",
    applied_in=(),
    when_fixed="nothing to remove",
    canary="test_sum_reduce_empty_axis_aborts",
)

# --- tract_core_scan ---------------------------------------------------------------------------------
SCAN_SQUEEZE_MATMUL_NEVER_LOADS = Quirk(
    name="a scan body mixing squeeze/unsqueeze with a matmul on the state never finishes loading",
    does="a body 'y_t = matmul(unsqueeze(squeeze(q_t, axes = [0]), axes = [2]), s_prev)' with y stacked on "
         "axis 2 keeps tract's loader busy forever (memory grows; over 90 s seen). Not every mix hangs: a "
         "body that squeezes its inputs and its rank-5 state and multiplies by the state in the recurrent "
         "lowering's row/column layout loaded in 20 ms, so the rule the comments state is broader than what "
         "was reproduced.",
    workaround="the per-token step of the scan lowering and the chunked tail is elementwise arithmetic and "
               "reductions only; the recurrent lowering keeps the size-1 scan axis on its state (rank 6); "
               "chunk bodies move axes with reshapes, not squeeze/unsqueeze",
    applied_in=("gdn_export/ops/gated_delta_rule/nnef/steps.py", "gdn_export/ops/gated_delta_rule/nnef/recurrent.py", f"{CHUNKED}gdn.py"),
    when_fixed="the recurrent body may squeeze its state (rank 5, like the elementwise step that measured 4x "
               "faster) and gdn.heads_first may squeeze",
    canary="test_scan_squeeze_matmul_never_loads",
)

SCAN_HOISTS_SINGLE_INPUT_OPS = Quirk(
    name="a body op fed by one scan input alone is moved out of the loop",
    does="a body op whose only varying input is one scan input (e.g. 'exp(x_t)') is extracted and run on the "
         "whole sequence before the loop (nodes named '<scan>.extracted.*'), outside the per-chunk concrete "
         "shapes; combining it with a second scan input ('x_t * one_t') keeps it in the loop.",
    workaround="chunk bodies concatenate k and q before anything else (gdn.py) or multiply every scan "
               "input by a per-chunk ones input 'one_t' (general.py)",
    applied_in=(f"{CHUNKED}gdn.py", f"{CHUNKED}general.py"),
    when_fixed="the q/k concat kept for this reason and the '* one_t' pins can go",
    canary="test_scan_hoists_single_input_ops",
)

SCAN_SAME_INPUT_TWICE_ABORTS = Quirk(
    name="a body matmul reading one scan input twice aborts the load",
    does="a body 'matmul(x_t, x_t, transposeB = true)' panics while tract declutters the scan "
         "('internal error: entered unreachable code', core/src/ops/scan/decluttered.rs:448): the process "
         "aborts. The elementwise 'x_t * x_t' loads.",
    workaround="the same pins as above: every body op reads at least two different scan inputs",
    applied_in=(f"{CHUNKED}outer.py", f"{CHUNKED}gdn.py", f"{CHUNKED}general.py"),
    when_fixed="together with the hoisting quirk, the pins can go",
    canary="test_scan_same_input_twice_aborts",
)

SCAN_MATMUL_BY_CONSTANT_FAILS = Quirk(
    name="a body matmul of a scan input by a constant fails to load",
    does="stated by chunked/gdn.py (cumulative_decay) and chunked/outer.py; in a minimal graph "
         "('matmul(x_t, w)', w a variable passed as a full input) tract extracts the matmul out of the loop "
         "and the model loads and runs",
    workaround="the cumulative log decay (a matmul by a lower-triangular constant) is computed before the "
               "chunk scan",
    applied_in=(f"{CHUNKED}gdn.py",),
    when_fixed="nothing to remove (computing it before the scan is cheap either way)",
    no_canary="not reproduced in a minimal graph on 0.23.9; the extraction itself is SCAN_HOISTS_SINGLE_INPUT_OPS",
    reproduced=False,
)

SCAN_HOISTS_FULL_OUTPUT_OPS = Quirk(
    name="ops writing a 'full' output of chunk 1 are moved after the loop",
    does="with output ('y_t', 'full', axis, 1), the ops computing y_t from the state are run after the loop "
         "on the stacked states (top-level nodes); with a chunk > 1 they stay in the body.",
    workaround="chunk scans emit y with the chunk size C (> 1), already in the node's layout",
    applied_in=(f"{CHUNKED}outer.py", f"{CHUNKED}gdn.py", f"{CHUNKED}general.py"),
    when_fixed="nothing has to change; y could leave with any chunk",
    canary="test_scan_hoists_full_output_ops",
)

SCAN_ZERO_ITERATIONS_LAST_IS_SCALAR = Quirk(
    name="a scan of zero iterations returns a scalar 0 for a 'last' output",
    does="with an empty scan input, a ('s_t', 'last', 0, 1) output is a rank-0 tensor holding 0, not the "
         "initial state.",
    workaround="the chunk scan emits its states as a 'full' output and takes the last of initial ++ states "
               "(FINAL fragment); the per-token tail always runs at least one step (a zero step, PAD "
               "fragment, when S is a multiple of C)",
    applied_in=(f"{CHUNKED}outer.py", f"{CHUNKED}gdn.py", f"{CHUNKED}general.py"),
    when_fixed="the FINAL and PAD fragments, the 'full' state output and the zero step can go",
    canary="test_scan_zero_iterations_last_is_scalar",
)

SCAN_STATIC_EMPTY_INPUT_DOES_NOT_LOAD = Quirk(
    name="a scan over a static zero-length slice does not load",
    does="a scan input that is a slice of static length 0 (what the SPLIT fragment leaves for a static S "
         "below one chunk) types the body input both [C, ..] and [0, ..] and fails to load ('inconsistent "
         "fact'); an external input of length 0 loads. (A static length that is not a multiple of the chunk "
         "runs ceil(len / C) steps and returns whole chunks: 2 rows scanned 4 at a time give 4 output rows.)",
    workaround="the chunked lowering refuses a static S below one chunk (chunked.refusal)",
    applied_in=(f"{CHUNKED}__init__.py",),
    when_fixed="chunked_refusal's static-S rule would only be about speed",
    canary="test_scan_static_empty_input_does_not_load",
)

SCAN_ITERATIONS_FROM_FIRST_INPUT = Quirk(
    name="a scan counts its iterations on its first scan input",
    does="stated by chunked/outer.py: counted on a per-token input the count is (63 + 64*(S/64))/64, never "
         "simplified. Not what 0.23.9 showed here: moving the uncut q before the per-chunk input of a "
         "chunk scan left the output facts (64*(S/64), S/64) and the results unchanged, and in a minimal "
         "scan the order of a per-chunk and a per-token input did not change the count either",
    workaround="per-chunk scan inputs come first in every chunk scan",
    applied_in=(f"{CHUNKED}outer.py", f"{CHUNKED}gdn.py", f"{CHUNKED}general.py"),
    when_fixed="nothing to remove (the order costs nothing)",
    no_canary="not reproduced on 0.23.9 (order-independent in both probes)",
    reproduced=False,
)

SCAN_STATE_SCAN_AXIS_SLOW = Quirk(
    name="keeping the size-1 scan axis on a scan state is slow",
    does="an elementwise body over a rank-6 state [1, B, Hk, G, K, V] ran 4x slower than over a rank-5 "
         "[B, Hk, G, K, V], which (with G = 1, a unit axis between H and K) ran 2x slower than [B, H, K, V]; "
         "[1, B, H, K, V] costs ~10% more than [B, H, K, V] (H=16, K=V=128, one token)",
    workaround="the elementwise step runs on [1, B, H, K, V] (value heads on one axis, the scan axis in front: "
               "the state leaves as a squeeze that keeps its output name)",
    applied_in=("gdn_export/ops/gated_delta_rule/nnef/steps.py",),
    when_fixed="nothing to remove",
    no_canary="a speed effect (benchmarks/bench_lowerings.py)",
    kind="measured",
)

# --- symbolic shapes ---------------------------------------------------------------------------------
SYMBOLIC_OPERANDS_GENERIC_KERNELS = Quirk(
    name="binary ops over operands sharing a symbolic shape keep tract's generic kernel",
    does="'add(x, z)' with x, z both [B, 16, 4096] stays 'Add' (0.23 ms) where B = 1 fixed gives "
         "'OptAddUnicast' (0.023 ms); an operand with a concrete shape broadcast against a symbolic one does "
         "get the optimized kernel. The chunked comments measure ~10x on whole GDN graphs; Session measured a "
         "decode step at 1.9 ms against 0.5 ms.",
    workaround="Session plans the model with tract.SetSymbols({'B': batch}) at its first call; chunk bodies "
               "compute everything per chunk inside the scan, where shapes are concrete; the serving Engine "
               "keeps B symbolic (one plan, one packed copy of the weights) and pays 1.01-1.14x a decode step "
               "(docs/SERVING.md)",
    applied_in=("gdn_export/run/session.py", "gdn_export/run/runtime.py", f"{CHUNKED}outer.py"),
    when_fixed="Session's per-batch planning only saves little; 'extension tract_assert B >= 1' already "
               "turns the generic Add into OptAddUnicast on 0.23.9 (not used by gdn_export yet)",
    canary="test_symbolic_operands_generic_kernels",
)

SYMBOLIC_COPY_SLOW = Quirk(
    name="a big copy of a symbolic-length tensor is slow",
    does="copying (slicing out) the whole chunks of a symbolic-length q/k/v ran ~10x slower than the body's "
         "per-chunk reads",
    workaround="chunk scans read the uncut q, k, v and stop after the whole chunks (no copy of them)",
    applied_in=(f"{CHUNKED}outer.py", f"{CHUNKED}gdn.py", f"{CHUNKED}general.py"),
    when_fixed="nothing to remove",
    no_canary="a speed effect (benchmarks/bench_lowerings.py)",
    kind="measured",
)

RESHAPE_MINUS_ONE_ON_SYMBOL = Quirk(
    name="reshape with -1 on a plain symbolic extent resolves -1 to the symbol",
    does="'reshape(x [S, 3], shape = [-1, 4], axis_start = 0, axis_count = 1)' fails to load ('S should be "
         "equal to 4*S'): -1 becomes S, not S/4. An extent tract knows to be a multiple (4*(S/4)) reshapes.",
    workaround="operands are first cut where q's whole chunks end (SPLIT fragment: C*(S/C) and the rest), "
               "and only the whole-chunk part is reshaped [-1, C]; the scan itself slices C tokens a step",
    applied_in=(f"{CHUNKED}outer.py", f"{CHUNKED}gdn.py", f"{CHUNKED}general.py"),
    when_fixed="nothing forces a change (the cut is needed for the tail anyway)",
    canary="test_reshape_minus_one_on_symbol",
)

SYMBOLIC_TAIL_RESHAPE_LENGTH = Quirk(
    name="the length of a reshaped symbolic tail comes out wrong",
    does="stated by chunked/outer.py (cut_operands): S - 64*(S/32) for (2S - 64*(S/32)) / 2. A minimal graph "
         "(a [2S] tail cut at 64*(S/32), reshaped [-1, 2]) got S - 32*(S/32), correct, and ran right",
    workaround="k, v and beta get their sub-steps on an axis of their own before the cut",
    applied_in=(f"{CHUNKED}outer.py",),
    when_fixed="nothing to remove (the split axis is also what the body reads)",
    no_canary="not reproduced in a minimal graph on 0.23.9",
    reproduced=False,
)

SYMBOLIC_MIN_MAX_NOT_SIMPLIFIED = Quirk(
    name="symbols have no lower bound: clamped extents keep min()/max()",
    does="a slice ending at min(B, 1) has the extent min(B, 1), never 1 (tract does not know B >= 1); "
         "torch-to-nnef clamps every dynamic slice bound (dyn_slice / within_bound_index), so torch's "
         "x[:1] becomes min(B,1) - min(B,0), which tract then cannot match with other extents. With "
         "'extension tract_assert B >= 1' the same extent is 1.",
    workaround="positions index input_ids[0] (a select, extent 1) instead of slicing [:1]; Qwen4-Exp shifts "
               "windows with pads on both sides instead of slices",
    applied_in=("gdn_export/models/blocks.py", "gdn_export/hf/families/qwen4_exp.py"),
    when_fixed="the select/pad spellings could become plain slices",
    canary="test_symbolic_min_max_not_simplified",
)

POOL_NEEDS_STATIC_CHANNELS = Quirk(
    name="pooling needs a static channel axis",
    does="max_pool over x [1, S, 8] (symbolic axis 1) fails to load ('Undetermined symbol in expression'); "
         "[1, 4, S] loads.",
    workaround="Qwen4-Exp's window max is pooled as 2-D with one channel",
    applied_in=("gdn_export/hf/families/qwen4_exp.py",),
    when_fixed="the pool could run on the natural layout",
    canary="test_pool_needs_static_channels",
)

# --- graph rewriting inside tract's optimizer --------------------------------------------------------
SLICES_PUSHED_INTO_MATMULS = Quirk(
    name="slices of a matmul's rows are pushed into the matmul",
    does="slicing the rows of a matmul's output splits the matmul into one matmul per slice, each packing "
         "its operands again (nodes 'm.split-over-0.0..8', two OptMatMul for two slices)",
    workaround="chunk bodies cut blocks on a block axis of reshaped views [.., n, s, ...], never on the "
               "token axis itself",
    applied_in=(f"{CHUNKED}outer.py", f"{CHUNKED}gdn.py", f"{CHUNKED}general.py"),
    when_fixed="blocks could be plain slices of the token axis",
    canary="test_slices_pushed_into_matmuls",
)

MATMUL_OF_CONCAT_SPLIT = Quirk(
    name="a matmul over a concat along the contraction axis is split per piece",
    does="matmul(concat([a, b], axis = 1), w) becomes one matmul per piece plus an add ('concat-einsum-k'), "
         "each packing again; a concat along the rows is kept. With a constant w the pieces are slices of w: a "
         "Q4_0 w then aborts the load (Q4_0_GATHER_NEEDS_DATUM_TYPE: a Q4_0 constant cannot be sliced)",
    workaround="the forward substitution concatenates solved blocks on a block axis of a reshaped view; the MTP "
               "head's fc over [normed embedding | normed hidden] is exported as two linear layers of their own "
               "(models/mtp.py SplitFC), in every weight format",
    applied_in=(f"{CHUNKED}body.py", "gdn_export/models/mtp.py"),
    when_fixed="solved blocks could be concatenated on the token axis; MTPHead.split_fc could go for float "
               "weights (a Q4_0 fc still needs it while a Q4_0 constant cannot be sliced)",
    canary="test_matmul_of_concat_split",
)

# --- operators ---------------------------------------------------------------------------------------
SIGMOID_FLOOR = Quirk(
    name="sigmoid bottoms out at ~4.5e-7",
    does="sigmoid(x) is 4.47e-7 for every x below about -14.6 (the true value is 3.1e-7 at -15, 2e-9 at -20)",
    workaround="Kimi-Linear's routing scores are spelled 1 / (1 + exp(-x)) (renormalizing top-k scores of "
               "that size would turn the floor into O(1) weight errors)",
    applied_in=("gdn_export/models/blocks.py",),
    when_fixed="the routing may use sigmoid",
    canary="test_sigmoid_floor",
)

SCATTER_NEGATIVE_AXIS_ABORTS = Quirk(
    name="scatter_elements with a negative axis aborts the process",
    does="tract_core_scatter_elements(..., axis = -1) panics at run ('index out of bounds', "
         "scatter_elements.rs:31): the process aborts. torch-to-nnef 0.24.12 passes torch's axis unnormalized.",
    workaround="every scatter names its axis as a non-negative number (1)",
    applied_in=("gdn_export/models/blocks.py",),
    when_fixed="scatters may name axis -1",
    canary="test_scatter_negative_axis_aborts",
)

SCATTER_SCALAR_SOURCE_ABORTS = Quirk(
    name="scatter_elements with a scalar source aborts the process",
    does="tract_core_scatter_elements(x, i, 1.0, axis = 1) (what torch-to-nnef writes for "
         "tensor.scatter(1, i, 1.0)) panics at run ('ndarray: index out of bounds'): the process aborts.",
    workaround="Kimi-Linear's group mask is one-hot rows summed, not a scatter",
    applied_in=("gdn_export/models/blocks.py",),
    when_fixed="the group mask may be a scatter",
    canary="test_scatter_scalar_source_aborts",
)

GATHER_OUT_OF_RANGE_ABORTS = Quirk(
    name="a gather index out of range aborts the process",
    does="tract_core_gather (torch-to-nnef's embedding) with an index >= the table's rows, or < -rows, "
         "panics at run ('range end index ... out of range', gather.rs:85): the process aborts. Indices in "
         "[-rows, -1] wrap like Python's.",
    workaround="Session.prefill refuses token ids outside [0, vocab_size) (the archive's gdn_export.json) "
               "before calling tract; run_tract and the bindings called directly do not check",
    applied_in=("gdn_export/run/session.py",),
    when_fixed="Session's id check could rely on a tract error instead (it stays useful as a clear message)",
    canary="test_gather_out_of_range_aborts",
)

FUSED_GDN_NEEDS_K_EQ_V = Quirk(
    name="the fused GDN op needs K = V",
    does="tract_transformers_gdn_recurrent refuses K != V ('GDN value must be [b, S, G*hk, w] with "
         "query/key [b, S, hk, w]'), a TractError",
    workaround="the fused lowering refuses every node with K != V (fused.refusal)",
    applied_in=("gdn_export/ops/gated_delta_rule/nnef/fused.py", "gdn_export/ops/gated_delta_rule/nnef/capabilities.py"),
    when_fixed="fused.refusal's K != V rule can become version-dependent",
    canary="test_fused_gdn_needs_k_eq_v",
)

FUSED_GDN_F32_LOG_DECAY = Quirk(
    name="the fused GDN op takes an f32 log-decay only",
    does="an f16 log_decay with f16 q/k/v/beta is refused ('unsupported GDN dtype combination')",
    workaround="fused.py casts g to f32 whatever the operands' dtype",
    applied_in=("gdn_export/ops/gated_delta_rule/nnef/fused.py",),
    when_fixed="the cast can go for f16 models",
    canary="test_fused_gdn_f32_log_decay",
)

FUSED_GDN_SEMANTICS = Quirk(
    name="the fused GDN op normalizes q/k, scales q and repeats key heads itself",
    does="tract_transformers_gdn_recurrent computes y_t = S_t^T (l2norm(q_t) / sqrt(K)) with k normalized "
         "too (eps 1e-6 added), value head h reading key head h // (H/Hk), any S (symbolic), f32 operands",
    workaround="fused.refusal accepts only nodes that normalize inside the node with scale 1/sqrt(K) "
               "(capabilities.FUSED_TABLE's 0.23.7 row)",
    applied_in=("gdn_export/ops/gated_delta_rule/nnef/fused.py", "gdn_export/ops/gated_delta_rule/nnef/capabilities.py"),
    when_fixed="if tract changes the op's function, the emitter must stop choosing it",
    canary="test_fused_gdn_semantics",
    kind="reliance",
)

CAUSAL_CONV_SEMANTICS = Quirk(
    name="the fused causal conv computes silu(conv(state ++ x)) and keeps the last W inputs",
    does="tract_transformers_causal_conv1d_update(x [B, C, S], w [C, W], state [B, C, W]) returns "
         "silu(sum_i w[:, i] * (state ++ x)[:, :, 1 + i : 1 + i + S]) and the last W columns of state ++ x, "
         "any S, symbolic too",
    workaround="causal_conv1d/nnef.py uses it from 0.23.5 on for an f16 t2n_extra::causal_conv1d_update, whatever "
               "the GDN lowering (an f32 one is a scan over chunks of tokens: faster)",
    applied_in=("gdn_export/ops/causal_conv1d/nnef.py",),
    when_fixed="if tract changes the op's function, conv.decide must stop choosing it",
    canary="test_causal_conv_semantics",
    kind="reliance",
)

CONV_SHIFTED_SLICES_LENGTH = Quirk(
    name="W shifted slices of a symbolic axis get lengths tract cannot equate with S",
    does="stated by conv.py (and the commit that changed it: a load of the FLA KDA fixture with the old form "
         "never finished): W slices of state ++ x whose ends count from the end of the symbolic axis had "
         "lengths tract could not prove equal to S. Not re-checked: the form is gone from the code",
    workaround="the portable conv (tract < 0.23.5) is NNEF's depthwise conv over state[:, :, 1:] ++ x, whose "
               "S + W - 1 columns give exactly S; from 0.23.5 the fused conv is used whatever the lowering",
    applied_in=("gdn_export/ops/causal_conv1d/nnef.py",),
    when_fixed="nothing to remove",
    no_canary="not re-checked: the slice form no longer exists to compare against",
    reproduced=False,
)

# --- runtimes ----------------------------------------------------------------------------------------
CUDA_EMPTY_TENSORS = Quirk(
    name="tract's CUDA runtime fails on empty tensors",
    does="on an H200 with the 0.23.9 wheel, CudaNeg, CudaSquare, CudaExp and CudaReduce<Sum> over a [0, 4] "
         "tensor fail with CUDA_ERROR_INVALID_VALUE (add, mul and matmul are fine); the chunked graph has "
         "empty pieces whenever S < C (no whole chunk) or C divides S (no remainder)",
    workaround="the cuda policy never offers the chunked lowering",
    applied_in=("gdn_export/ops/gated_delta_rule/nnef/policy.py",),
    when_fixed="policy.candidates('cuda') may offer 'chunked' (it ran at CPU speed where it ran, so measure)",
    canary="test_cuda_empty_tensors",
    no_canary="needs a CUDA device: the canary skips without one (checked on an H200 for this entry)",
)

GLIBC_BUFFER_REMAPPING = Quirk(
    name="glibc re-maps tract's per-call buffers",
    does="not tract's doing: glibc's adaptive mmap/trim thresholds can serve tract's big per-call buffers "
         "with fresh mmaps every call, page-faulted anew (a fused decode step 3.6 ms against 2.2 ms, a "
         "chunked one 2.05 against 0.58 ms, depending on the process's history)",
    workaround="steady_allocator() fixes M_MMAP_THRESHOLD at 32 MiB and never trims; Session applies it",
    applied_in=("gdn_export/run/runtime.py", "gdn_export/run/session.py"),
    when_fixed="nothing to remove",
    no_canary="a speed effect of the process's allocator (benchmarks/bench_decode_floor.py)",
    kind="measured",
)

FUSED_GDN_SLOW_ON_CPU = Quirk(
    name="the fused GDN op is the slowest exact form on CPU",
    does="tract_transformers_gdn_recurrent runs one token at a time through a generic kernel on CPU "
         "(S=2048: 860-1560 ms against 82 ms for the chunked graph); on CUDA with f16 operands it has a "
         "GPU kernel (29 ms), with f32 operands none",
    workaround="the cpu policy tries chunked first; the cuda policy the fused op",
    applied_in=("gdn_export/ops/gated_delta_rule/nnef/policy.py",),
    when_fixed="re-measure the policy (benchmarks/bench_lowerings.py, bench_tract_runtimes.py)",
    no_canary="a speed effect (benchmarks/RESULTS.md)",
    kind="measured",
)

# --- torch-to-nnef -----------------------------------------------------------------------------------
T2N_TARGET_DOWNLOADS_TRACT = Quirk(
    name="TractNNEF downloads a tract binary in its constructor",
    does="torch-to-nnef's TractNNEF(version) calls TractCli.download(version) (GitHub) unless "
         "specific_tract_binary_path is given, whether or not check_io is set",
    workaround="OfflineTractTarget builds it with TractCli.download replaced by a stand-in that only answers "
               "the version, check_io off; checks run through tract's Python bindings",
    applied_in=("gdn_export/backends/nnef/target.py", "gdn_export/backends/compat/torch_to_nnef.py"),
    when_fixed="the download stand-in can go",
    canary="test_t2n_target_downloads_tract",
    seen_on=TORCH_TO_NNEF_SEEN_ON,
    library="torch-to-nnef",
)

T2N_REGISTRY_REFUSES_SECOND_HANDLER = Quirk(
    name="torch-to-nnef's t2n_extra registry asserts on a second registration, and its own GDN rules are stale",
    does="OpRegistry.register asserts the name is new ('gated_delta_scan' is registered by torch-to-nnef "
         "itself); its fused-op rules refuse any graph with dynamic axes (right for 0.23.5-0.23.6 only)",
    workaround="gdn_export writes its handlers (backends/nnef/registry.py) into the registry's dict for the "
               "duration of an export, torch-to-nnef's own restored after; the target is built with "
               "native_gated_delta_op=False",
    applied_in=("gdn_export/backends/nnef/registry.py", "gdn_export/backends/compat/torch_to_nnef.py", "gdn_export/backends/nnef/target.py"),
    when_fixed="handlers could be registered through the public decorator",
    canary="test_t2n_registry_refuses_second_handler",
    seen_on=TORCH_TO_NNEF_SEEN_ON,
    library="torch-to-nnef",
)

T2N_ONES_LIKE_INT64 = Quirk(
    name="torch-to-nnef keeps the source dtype of ones_like(..., dtype=int64)",
    does="ones_like(f, dtype=torch.int64).cumsum(-1) - 1 is written with f's float dtype and an f32 '- 1' "
         "cast that tract rejects",
    workaround="Qwen4-Exp's token positions are computed in f32 (exact below 2**24)",
    applied_in=("gdn_export/hf/families/qwen4_exp.py",),
    when_fixed="positions may be int64",
    no_canary="needs a torch export to show; not re-checked here",
    seen_on=TORCH_TO_NNEF_SEEN_ON,
    library="torch-to-nnef",
    reproduced=False,
)

T2N_SORTED_TOPK_ONLY = Quirk(
    name="torch-to-nnef exports only sorted topk",
    does="topk(..., sorted=False) is not exported",
    workaround="Kimi-Linear's routing uses sorted topk (the chosen set, hence the weights, is the same)",
    applied_in=("gdn_export/models/blocks.py",),
    when_fixed="nothing to remove",
    no_canary="needs a torch export to show; not re-checked here",
    seen_on=TORCH_TO_NNEF_SEEN_ON,
    library="torch-to-nnef",
    reproduced=False,
)

T2N_SET_ORDER_NAMES = Quirk(
    name="torch-to-nnef's NNEF names and fragment order follow set iteration (PYTHONHASHSEED)",
    does="nodes made after the trace are re-sorted with key -1 (set order), a tensor with two names (a tied head) "
         "is named list(names)[0] of a set, fragments come from a set of keys: two conversions of one checkpoint "
         "gave different graph.nnef files (c26/c57, hf.lm_head.weight or hf.model.embed_tokens.weight)",
    workaround="those nodes sorted by name, a tensor's names iterated sorted, fragments written sorted",
    applied_in=("gdn_export/backends/compat/torch_to_nnef.py",),
    when_fixed="compat's deterministic order can go",
    canary="test_compat.py::test_t2n_set_order_names",  # and test_checkpoints.py converts under two PYTHONHASHSEEDs
    seen_on=TORCH_TO_NNEF_SEEN_ON,
    library="torch-to-nnef",
)

T2N_QUADRATIC_SHAPE_INFERENCE = Quirk(
    name="torch-to-nnef's shape inference is quadratic in the number of ops",
    does="_infer_missing_shapes_from_ops_outputs filters its work list with 'op not in list', comparing ops field "
         "by field: a third of a 20-layer conversion (py-spy)",
    workaround="the same loop with ops compared by identity",
    applied_in=("gdn_export/backends/compat/torch_to_nnef.py",),
    when_fixed="the replacement loop can go",
    canary="test_compat.py::test_t2n_quadratic_shape_inference",  # the code replaced; the effect is a speed
    seen_on=TORCH_TO_NNEF_SEEN_ON,
    library="torch-to-nnef",
    kind="measured",
)

T2N_QUADRATIC_GRAPH_EDITS = Quirk(
    name="torch-to-nnef's submodule merges and translation are quadratic in the number of layers",
    does="_merge_subraph drops each call with 'op != callmethod_node' and the NNEF translation filters its work list "
         "with 'op not in done_nodes', comparing TorchOps field by field (dataclass __eq__); remap_node sets a new "
         "equal item list in every container of the graph, so every op reading one runs its shape inference again "
         "after every remap: the trace of the 48-layer 0.8B shape took 4x the 24-layer one's (cProfile: the "
         "shape inference 84 s, remap_node 32 s, __eq__ 8 s of a 214 s profiled conversion)",
    workaround="TorchOp compared by identity during a conversion (its dataclass __eq__ removed: object's, in C); "
               "remap_node sets only the containers that hold the remapped node",
    applied_in=("gdn_export/backends/compat/torch_to_nnef.py",),
    when_fixed="the TorchOp.__eq__ and remap_node patches can go",
    canary="test_compat.py::test_t2n_quadratic_graph_edits",  # the code replaced; the effect is a speed
    seen_on=TORCH_TO_NNEF_SEEN_ON,
    library="torch-to-nnef",
    kind="measured",
)

T2N_CLONES_TENSORS_PER_OP = Quirk(
    name="torch-to-nnef copies a module tensor each time an op reads it",
    does="NamedTensor.__torch_function__ clones every module tensor it passes to an op (the jit trace and the "
         "shape inference after it): a full copy of a 1.2 GB head per op, and a placeholder's pages written",
    workaround="outside the jit trace, a streamed export's placeholder is 'cloned' as a new placeholder",
    applied_in=("gdn_export/weights/streamed.py", "gdn_export/backends/compat/torch_to_nnef.py"),
    when_fixed="the clone wrapper can go",
    canary="test_compat.py::test_t2n_streamed_weight_hooks",  # the code wrapped; the effect: benchmarks/RESULTS.md
    seen_on=TORCH_TO_NNEF_SEEN_ON,
    library="torch-to-nnef",
    kind="measured",
)

T2N_COMPILES_AT_IMPORT = Quirk(
    name="torch-to-nnef compiles a function at import",
    does="tensor/quant/base.py wraps QScalePerGroupF16._dequantize in torch.compile when imported, which imports "
         "torch's inductor: about 1.2 s of CPU in every process that imports torch-to-nnef",
    workaround="gdn_export imports torch-to-nnef with a meta-path finder, for that import only, that runs that one "
               "module with torch.compile as the identity (its quantized tensors, which gdn_export never uses, "
               "dequantize eagerly)",
    applied_in=("gdn_export/backends/compat/torch_to_nnef.py", "gdn_export/backends/nnef/__init__.py"),
    when_fixed="the finder can go",
    canary="test_compat.py::test_t2n_compiles_at_import",
    seen_on=TORCH_TO_NNEF_SEEN_ON,
    library="torch-to-nnef",
    kind="measured",
)

T2N_READS_WEIGHT_VALUES = Quirk(
    name="torch-to-nnef decides from weight values",
    does="a mul or div by a constant of ones is dropped (remap_if_neutral_op), products of constants are folded: "
         "with placeholder weights a (1 + w) norm lost its multiplication (logit error 4.2)",
    workaround="streamed exports trace parameters under 1 MiB with their real values; a neutral-op drop on, or a "
               "written constant of, 1 MiB or more that is no weight stops the export",
    applied_in=("gdn_export/weights/streamed.py", "gdn_export/backends/compat/torch_to_nnef.py", "gdn_export/hf/checkpoint.py"),
    when_fixed="reliance: placeholders must stay out of those decisions",
    canary="test_compat.py::test_t2n_streamed_weight_hooks",  # and test_streamed.py compares streamed / in memory
    seen_on=TORCH_TO_NNEF_SEEN_ON,
    library="torch-to-nnef",
    kind="reliance",
)


CAST_WEIGHT_NOT_FOLDED = Quirk(
    name="tract neither folds a cast of a constant weight nor packs the cast result",
    does="an f16 weight cast to f32 before a matmul is cast on every call and the matmul runs unpacked: 20-40x "
         "slower than a packed f32 or f16 matmul (measured by the issue that asked for this test)",
    workaround="weights the graph only casts are stored in the cast's type (weights/casts.py); "
               "tests/test_quantized.py fails when a float16 archive still casts a weight matrix",
    applied_in=("gdn_export/weights/casts.py", "gdn_export/backends/nnef/exporter.py"),
    when_fixed="the stored-as-cast rewrite can go",
    no_canary="a speed effect; the test checks the graphs instead",
    kind="measured",
)

T2N_POST_TRACE_BEFORE_WRITE = Quirk(
    name="torch-to-nnef hands its target the translated graph before writing it",
    does="export_model_to_nnef calls inference_target.post_trace(nnef_graph, extensions) once every node is "
         "translated and before NNEFWriter writes graph.nnef and the weights (torch_to_nnef/export.py, "
         "_build_nnef_graph_and_fragments); attributes set on the graph's operations there are printed as given",
    workaround="OfflineTractTarget.post_trace runs the export's graph passes on that graph (the weights only cast "
               "before use, weights/casts.py; the datum_type of gathers over a Q4_0 table, weights/streamed.py), "
               "so graph.nnef is written right the first time instead of patched as text afterwards",
    applied_in=("gdn_export/backends/nnef/target.py", "gdn_export/backends/nnef/exporter.py", "gdn_export/weights/casts.py",
                "gdn_export/weights/streamed.py"),
    when_fixed="reliance: if the hook moves, the passes move with it (the canary fails first)",
    canary="test_compat.py::test_t2n_post_trace_runs_before_writing",
    seen_on=TORCH_TO_NNEF_SEEN_ON,
    library="torch-to-nnef",
    kind="reliance",
)

Q4_0_GATHER_NEEDS_DATUM_TYPE = Quirk(
    name="tract's gather over a Q4_0 table needs an explicit output type, and a Q4_0 table cannot be sliced",
    does="tract_core_gather on a block-quantized constant fails at load ('requires an explicit datum_type "
         "attribute'); a slice of one fails in PropConst (BlockQuantStorage::materialize_plain_ram)",
    workaround="gathers over a Q4_0 embedding table get datum_type (a graph pass before writing: "
               "T2N_POST_TRACE_BEFORE_WRITE); --quantize-embeddings is refused for a head tied to its table (read "
               "as two slices)",
    applied_in=("gdn_export/weights/streamed.py", "gdn_export/hf/weight_writers.py", "gdn_export/backends/nnef/target.py"),
    when_fixed="a tied table could be quantized too",
    no_canary="tests/test_quantized.py converts a Q4_0 table (untied) and refuses the tied one",
)


# --- tract_moe_ffn (gdn_export/ops/moe_ffn/op.py) ---------------------------------------------------------
MOE_TIES_LOWEST_INDEX = Quirk(
    name="tract_moe_ffn breaks exact router ties by the lowest expert index",
    does="experts with exactly equal router logits at the k-th place: tract_moe_ffn takes the lowest indices "
         "(8 equal logits, k=3: experts 0, 1, 2), where torch.topk on CPU takes others (6, 5, 4); tract's topk "
         "in the dense form decides ties its own way too",
    workaround="none: with continuous logits an exact tie does not happen (an all-zero token ties every logit, but "
               "its experts' outputs are all zero, so the choice does not matter)",
    applied_in=("gdn_export/ops/moe_ffn/op.py",),
    when_fixed="nothing to change; docs/TRACT.md states the tie rule",
    no_canary="canary in tests/test_moe.py (test_tied_logits_take_the_lowest_experts), beside the op's other checks",
    kind="reliance",
)

MOE_UNUSED_ROUTING_DROPPED = Quirk(
    name="tract drops the unused dense routing of a sparse MoE at load",
    does="the routing subgraph (softmax, topk, scatter) that feeds t2n_extra::moe_ffn is translated before the "
         "node is and stays in graph.nnef when tract_moe_ffn (which routes by itself) replaces the node; tract "
         "removes it while optimizing (no TopK or scatter node in the optimized model)",
    workaround="none: the written graph keeps those few unused ops; the archive holds no weight of its own for them",
    applied_in=("gdn_export/ops/moe_ffn/nnef.py",),
    when_fixed="reliance: an unused subgraph must cost nothing at run time",
    no_canary="checked by tests/test_moe.py (test_cpu_export_is_sparse_and_exact: the optimized model's nodes)",
    kind="reliance",
)


CONST_FOLD_NO_GROWTH = Quirk(
    name="tract folds a constant only where it does not grow",
    does="at load, an op on constants is evaluated into a constant only if its output is no larger than its "
         "inputs (or than 4 MiB): pad(variable) of more than 4 MiB stays a Pad node, slice(variable) then pad "
         "(smaller than the variable) folds; a tract_moe_ffn whose stacks are not constants at codegen stays the "
         "unplanned MoeFfn, 450x slower (197 ms against 0.44 ms, one decode token, 64 experts, D = 1024)",
    workaround="the given-routing tract_moe_ffn's widened expert stacks are written widened into the archive "
               "(hf.blocks.ExpertStacks: zeros appended as the checkpoint's stacks are written), so nothing is padded "
               "in the graph (which a Q4_0 stack could not be either)",
    applied_in=("gdn_export/hf/blocks.py",),
    when_fixed="the stacks could be widened in the graph again (the archive E / D smaller), in float exports",
    canary="test_const_fold_refuses_a_growing_pad",
    kind="workaround",
)


WEIGHT_COPIED_BY_AXIS_OPS = Quirk(
    name="tract copies a constant weight for every axis op on it while loading",
    does="an unsqueeze or transpose of a constant is folded into a new constant (PropConst: AxisOp::eval, a deep "
         "clone), and ChangeAxes moves axes of constants by cloning them again: torch-to-nnef's linear(x, "
         "unsqueeze(W)) copied every float weight at least once per start (0.8B float32: load 10.1 s -> 5.5 s and "
         "peak memory 4.6 -> 3.6 GB without those copies; perf: clear_page and memmove 39% of the load)",
    workaround="linear layers over a float weight are written as tract_core_einsum on the weight as stored "
               "(no axis op on it); the tied head's halves are sliced only (a slice is the one copy it needs)",
    applied_in=("gdn_export/backends/nnef/float_linears.py", "gdn_export/backends/nnef/exporter.py"),
    when_fixed="reliance-free: the einsum form stays as fast; the pass could go if tract folded axis ops by view",
    no_canary="a load-time and memory effect (benchmarks/bench_load.py); tests/test_tied_head.py checks the graphs",
    kind="measured",
)

EINSUM_KEEPS_ITS_NAME = Quirk(
    name="an einsum's output keeps its declared name",
    does="tract reports a graph output computed by tract_core_einsum under its declared name (declutter rewrites "
         "the EinSum in place), where a linear's output shows as '<name>_linear_output'",
    workaround="output_names.KEEP_THEIR_NAME: such an output is neither wrapped nor asked of tract",
    applied_in=("gdn_export/backends/nnef/output_names.py",),
    when_fixed="reliance: were it renamed, the wrap would be needed again (the canary fails first)",
    canary="test_output_names.py::test_names_without_the_weights_are_tracts_names",
    kind="reliance",
)

# --- torch ---------------------------------------------------------------------------------------------
TORCH_ONNX_PASSES_HOOKED = Quirk(
    name="torch's ONNX exporter folds and deduplicates initializers from their values, with no hook",
    does="the TorchScript exporter's constant folding (_jit_pass_onnx_constant_fold) and initializer "
         "deduplication read parameter values: with placeholder weights they would fold or merge wrong values, and "
         "nothing says which initializer came from which parameter",
    workaround="the streamed ONNX writer wraps the three torch._C passes for one export (one at a time): "
               "placeholders become sentinels, risky folds are recorded and refused, the final initializers kept",
    applied_in=("gdn_export/backends/compat/torch_onnx.py", "gdn_export/backends/onnx/streamed.py"),
    when_fixed="a public hook (or the dynamo exporter's external weights) could replace the wrapping",
    canary="test_compat.py::test_torch_onnx_passes_hooked",
    seen_on="2.13.0",
    library="torch",
)

TRANSFORMERS_FLA_KERNELS_WITHOUT_GPU = Quirk(
    name="transformers takes flash-linear-attention's kernels whenever the package imports, GPU or not",
    does="transformers' Qwen3.5 / Qwen3-Next modeling modules import fla's Triton gated delta rule when "
         "flash-linear-attention is installed, and call it on CPU tensors too: the reference then fails with "
         "Triton's '0 active drivers' on a machine without a GPU",
    workaround="the CPU references (gdn-export perplexity --reference; the test suite) put a None entry for 'fla' "
               "in sys.modules before transformers' model modules import, so transformers takes its torch path",
    applied_in=("gdn_export/checkpoints/reference.py",),
    when_fixed="the None entry can go once transformers checks the tensors' device before taking fla's kernels; "
               "gdn-export convert's check does not carry it yet (a CPU machine with fla installed fails its check)",
    no_canary="needs flash-linear-attention and Triton installed on a machine without a GPU, which the suite's "
              "environment is not",
    seen_on="5.24.0",
    library="transformers",
)

EQUAL_CONSTANTS_MERGED = Quirk(
    name="constants of equal values are one constant, packed per call when a gather reads it too",
    does="two variables with equal values (different labels and files; also once a reshape is folded: a [1, V, K] "
         "table and a [V, K] matrix) become one constant; when a gather and a matmul both read it and it is over "
         "4 MiB, the matmul's weight packing is not folded at load (a constant with two readers is not duplicated) "
         "but runs on every call: 272 ms of a 626 ms decode step for the int8 head of the 0.8B shape "
         "(151936 x 1024), whose codes equal its tied table's",
    workaround="an int8 archive's embedding tables are stored with their codes and scales negated (the same "
               "products), so that no table holds a head's values",
    applied_in=("gdn_export/weights/int8/codec.py", "gdn_export/hf/weight_writers.py"),
    when_fixed="the tables can be stored as they are (Int8Weights.negated can go)",
    canary="test_equal_constants_merged",
)


QUIRKS: tuple[Quirk, ...] = tuple(value for value in list(globals().values()) if isinstance(value, Quirk))


def by_name(name: str) -> Quirk:
    """The entry called ``name`` (its ``name`` field)."""
    for quirk in QUIRKS:
        if quirk.name == name:
            return quirk
    raise KeyError(name)
