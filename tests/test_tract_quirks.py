"""Canaries: one minimal NNEF graph per entry of ``gdn_export.tract_quirks``, showing the quirk still holds.

Each test passes while the installed tract (or torch-to-nnef) still behaves as the entry says, and fails the
day it does not, naming the workaround that can then go. Graphs that make tract abort the process (a Rust
panic across the FFI) run in a child process; the one that never finishes loading runs in a child that is
killed after ``HANG_SECONDS``.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tract

from gdn_export import tract_quirks as tq

HEADER = ("version 1.0;\nextension tract_registry tract_core;\nextension tract_registry tract_transformers;\n"
          "extension tract_symbol B;\nextension tract_symbol S;\nextension tract_symbol T;\n\n")
HANG_SECONDS = 5  # the same scan with the output on axis 0 loads in ~20 ms: 250x margin
CHILD_SECONDS = 60  # a child that should abort or finish quickly


def fixed(quirk: tq.Quirk) -> str:
    """The failure message of a canary: the quirk is gone, and what that allows."""
    return (f"tract {tract.version()}: '{quirk.name}' (seen on {quirk.library} {quirk.seen_on}) no longer holds; "
            f"{quirk.when_fixed} ({', '.join(quirk.applied_in) or 'no workaround in gdn_export'})")


def write(folder: Path, graph: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "graph.nnef").write_text(HEADER + textwrap.dedent(graph))
    return folder


def load(folder: Path, graph: str):
    return tract.nnef().with_tract_transformers().load(str(write(folder, graph)))


def output_names(model) -> list[str]:
    return [model.output_name(i) for i in range(model.output_count())]


def nodes(runnable) -> list[dict]:
    """tract's nodes after optimization, without running: op_name, node_name, qualified_id (the loop path)."""
    return json.loads(runnable.profile_json(None))["nodes"]


def top_level(node: dict) -> bool:
    return node["qualified_id"][0] == []


def child(folder: Path, graph: str, run: str, timeout: float) -> subprocess.CompletedProcess:
    """Load ``graph`` and execute ``run`` (Python, with ``runnable`` and ``np`` bound) in a child process."""
    write(folder, graph)
    code = textwrap.dedent(f"""
        import numpy as np, tract
        runnable = tract.nnef().with_tract_transformers().load({str(folder)!r}).into_runnable()
        print("LOADED", flush=True)
        """) + textwrap.dedent(run) + '\nprint("DONE", flush=True)\n'
    env = {**os.environ, "RUST_BACKTRACE": "0"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)


def assert_aborts(proc: subprocess.CompletedProcess, panic: str, quirk: tq.Quirk) -> None:
    assert proc.returncode == -signal.SIGABRT and panic in proc.stderr, (
        f"{fixed(quirk)}\nchild exit status {proc.returncode}\nstdout: {proc.stdout[-500:]}\n"
        f"stderr: {proc.stderr[-1500:]}")


# --- the registry itself -------------------------------------------------------------------------
def test_every_quirk_has_a_canary_or_a_reason():
    here = globals()
    root = Path(__file__).resolve().parents[1]
    names = [q.name for q in tq.QUIRKS]
    assert len(names) == len(set(names)), "two quirks share a name"
    for quirk in tq.QUIRKS:
        assert quirk.canary or quirk.no_canary, f"{quirk.name}: neither a canary nor a reason for none"
        if quirk.canary and "::" in quirk.canary:  # a canary of another test file: a test function defined there
            file, test = quirk.canary.split("::")
            defined = {node.name for node in ast.walk(ast.parse((Path(__file__).parent / file).read_text()))
                       if isinstance(node, ast.FunctionDef)}
            assert test in defined, f"{quirk.name}: no test {quirk.canary}"
        else:
            assert quirk.canary is None or callable(here.get(quirk.canary)), f"{quirk.name}: no test {quirk.canary}"
        for module in quirk.applied_in:
            assert (root / module).is_file(), f"{quirk.name}: {module} does not exist"
        assert quirk.kind in ("workaround", "reliance", "measured")


# --- output names ----------------------------------------------------------------------------------
def test_output_named_after_producer(tmp_path):
    copied = load(tmp_path / "copy", """
        graph G(x) -> (y) {
            x = external<scalar>(shape = [2, 3]);
            t = exp(x);
            y = copy(t);
        }
        """)
    linear = load(tmp_path / "linear", """
        graph G(x) -> (y) {
            x = external<scalar>(shape = [2, 3]);
            y = linear(x, [[1.0, 2.0, 3.0]], 0.0);
        }
        """)
    assert output_names(copied) == ["t"] and output_names(linear) != ["y"], (
        fixed(tq.OUTPUT_NAMED_AFTER_PRODUCER) + f": got {output_names(copied)}, {output_names(linear)}")


def test_select_keeps_its_name(tmp_path):
    model = load(tmp_path, """
        graph G(x) -> (y) {
            x = external<scalar>(shape = [B, 3]);
            t = exp(x);
            c = eq(max_reduce(t, axes = [0, 1]), 0.0);
            y = select(c, t, t);
        }
        """)
    assert output_names(model) == ["y"], fixed(tq.SELECT_KEEPS_ITS_NAME) + f": got {output_names(model)}"


def test_same_type_cast_removed(tmp_path):
    def reported(to: str) -> list[str]:
        return output_names(load(tmp_path / to, f"""
            graph G(x) -> (y) {{
                x = external<scalar>(shape = [2, 3]);
                t = exp(x);
                y = tract_core_cast(t, to = '{to}');
            }}
            """))

    assert reported("f32") == ["t"] and reported("f16") == ["y"], (
        fixed(tq.SAME_TYPE_CAST_REMOVED) + f": got {reported('f32')}, {reported('f16')}")


def test_fused_outputs_share_a_name(tmp_path):
    model = load(tmp_path, """
        graph G(x, w, s) -> (y, st) {
            x = external<scalar>(shape = [1, 4, S]);
            w = external<scalar>(shape = [4, 4]);
            s = external<scalar>(shape = [1, 4, 4]);
            (y, st) = tract_transformers_causal_conv1d_update(x, w, s);
        }
        """)
    assert output_names(model) == ["y", "y"], fixed(tq.FUSED_OUTPUTS_SHARE_A_NAME) + f": got {output_names(model)}"


def test_sum_reduce_empty_axis_aborts(tmp_path):
    proc = child(tmp_path, """
        graph G(x) -> (y) {
            x = external<scalar>(shape = [S]);
            y = sum_reduce(x, axes = [0]);
        }
        """, "runnable.run([np.zeros((0,), np.float32)])", CHILD_SECONDS)
    assert_aborts(proc, "attempt to divide by zero", tq.SUM_REDUCE_EMPTY_AXIS_ABORTS)


# --- tract_core_scan -------------------------------------------------------------------------------
SCAN_OVER_X = """
    graph G(x, one, s) -> (y, sf) {{
        x = external<scalar>(shape = [T, 4, 4]);
        one = external<scalar>(shape = [T, 1, 1]);
        s = external<scalar>(shape = [{chunk}, 4, 4]);
        (y, sf) = tract_core_scan(body = "step", scan = [("x_t", x, 0, {chunk}), ("one_t", one, 0, {chunk})],
            full = [], state = [("s_prev", s, "s_t")], output = [("y_t", "full", 0, {chunk}), ("s_t", "last", 0, 1)],
            skip = 0);
    }}
    """


def scan_over_x(body: str, chunk: int = 1) -> str:
    step = ("fragment step(s_prev: tensor<scalar>, x_t: tensor<scalar>, one_t: tensor<scalar>)\n"
            "    -> (s_t: tensor<scalar>, y_t: tensor<scalar>) {\n" + body + "\n}\n")
    return step + textwrap.dedent(SCAN_OVER_X.format(chunk=chunk))


@pytest.mark.slow
def test_scan_squeeze_matmul_never_loads(tmp_path):
    graph = """
        fragment step(s_prev: tensor<scalar>, q_t: tensor<scalar>) -> (s_t: tensor<scalar>, y_t: tensor<scalar>) {
            s_t = s_prev;
            y_t = matmul(unsqueeze(squeeze(q_t, axes = [0]), axes = [2]), s_prev);
        }
        graph G(q, s) -> (y, sf) {
            q = external<scalar>(shape = [T, B, 2, 16]);
            s = external<scalar>(shape = [B, 2, 16, 16]);
            (y, sf) = tract_core_scan(body = "step", scan = [("q_t", q, 0, 1)], full = [],
                state = [("s_prev", s, "s_t")], output = [("y_t", "full", AXIS, 1), ("s_t", "last", 0, 1)], skip = 0);
        }
        """
    control = child(tmp_path / "axis0", graph.replace("AXIS", "0"), "", CHILD_SECONDS)  # the same, stacked on axis 0
    assert control.returncode == 0 and "LOADED" in control.stdout, f"the control graph fails: {control.stderr[-800:]}"
    folder = write(tmp_path / "axis2", graph.replace("AXIS", "2"))
    code = f"import tract; tract.nnef().with_tract_transformers().load({str(folder)!r}); print('LOADED')"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RUST_BACKTRACE": "0"})
    try:
        out, err = proc.communicate(timeout=HANG_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return  # still loading after HANG_SECONDS: the quirk holds
    pytest.fail(f"{fixed(tq.SCAN_SQUEEZE_MATMUL_NEVER_LOADS)}: the load ended within {HANG_SECONDS} s "
                f"(exit {proc.returncode}, stdout {out[-200:]!r}, stderr {err[-800:]!r})")


def test_scan_hoists_single_input_ops(tmp_path):
    alone = load(tmp_path / "alone", scan_over_x("    s_t = s_prev + exp(x_t);\n    y_t = s_t;")).into_runnable()
    pinned = load(tmp_path / "pinned", scan_over_x("    s_t = s_prev + exp(x_t * one_t);\n    y_t = s_t;"))

    def extracted(runnable):
        return [n for n in nodes(runnable) if top_level(n) and ".extracted." in n["node_name"]]

    assert extracted(alone), fixed(tq.SCAN_HOISTS_SINGLE_INPUT_OPS)
    assert not extracted(pinned.into_runnable()), "the '* one_t' pin no longer keeps a body op in the loop"


def test_scan_same_input_twice_aborts(tmp_path):
    proc = child(tmp_path, scan_over_x("    s_t = s_prev + matmul(x_t, x_t, transposeB = true);\n    y_t = s_t;"), "",
                 CHILD_SECONDS)
    assert_aborts(proc, "entered unreachable code", tq.SCAN_SAME_INPUT_TWICE_ABORTS)


def test_scan_hoists_full_output_ops(tmp_path):
    body = "    s_t = s_prev + x_t * one_t;\n    y_t = exp(s_t) * one_t;"

    def exps(chunk):
        runnable = load(tmp_path / str(chunk), scan_over_x(body, chunk)).into_runnable()
        return [top_level(n) for n in nodes(runnable) if n["op_name"] == "Exp"]

    assert exps(1) == [True], fixed(tq.SCAN_HOISTS_FULL_OUTPUT_OPS) + f": Exp top-level flags {exps(1)}"
    assert exps(2) == [False], "with an output chunk > 1 the body's ops are no longer kept in the loop"


def test_scan_zero_iterations_last_is_scalar(tmp_path):
    runnable = load(tmp_path, scan_over_x("    s_t = s_prev + x_t * one_t;\n    y_t = s_t * one_t;")).into_runnable()
    y, last = (o.to_numpy() for o in runnable.run([np.zeros((0, 4, 4), np.float32), np.zeros((0, 1, 1), np.float32),
                                                   np.full((1, 4, 4), 5.0, np.float32)]))
    assert last.shape == () and float(last) == 0.0, fixed(tq.SCAN_ZERO_ITERATIONS_LAST_IS_SCALAR) + f": {last.shape}"


def test_scan_static_empty_input_does_not_load(tmp_path):
    graph = """
        fragment step(s_prev: tensor<scalar>, x_t: tensor<scalar>) -> (s_t: tensor<scalar>, y_t: tensor<scalar>) {
            s_t = s_prev + x_t;
            y_t = s_t;
        }
        graph G(x, s) -> (y, sf) {
            x = external<scalar>(shape = [10, 3]);
            s = external<scalar>(shape = [4, 3]);
            head = slice(x, axes = [0], begin = [0], end = [LENGTH]);
            (y, sf) = tract_core_scan(body = "step", scan = [("x_t", head, 0, 4)], full = [],
                state = [("s_prev", s, "s_t")], output = [("y_t", "full", 0, 4), ("s_t", "full", 0, 1)], skip = 0);
        }
        """
    load(tmp_path / "eight", graph.replace("LENGTH", "8"))  # the same graph over two chunks loads
    with pytest.raises(tract.TractError, match="inconsistent fact"):
        load(tmp_path / "empty", graph.replace("LENGTH", "0"))
        pytest.fail(fixed(tq.SCAN_STATIC_EMPTY_INPUT_DOES_NOT_LOAD))


# --- symbolic shapes ---------------------------------------------------------------------------------
def test_symbolic_operands_generic_kernels(tmp_path):
    graph = """
        graph G(x, z) -> (y) {
            x = external<scalar>(shape = [B, 16, 256]);
            z = external<scalar>(shape = [B, 16, 256]);
            y = add(x, z);
        }
        """
    symbolic = load(tmp_path / "symbolic", graph)
    planned = load(tmp_path / "planned", graph)
    planned.transform(tract.SetSymbols({"B": 1}))
    ops = lambda model: [n["op_name"] for n in nodes(model.into_runnable()) if n["op_name"] != "Source"]  # noqa: E731
    assert ops(planned) == ["OptAddUnicast"], f"B fixed by SetSymbols no longer gets the optimized add: {ops(planned)}"
    assert ops(symbolic) == ["Add"], fixed(tq.SYMBOLIC_OPERANDS_GENERIC_KERNELS) + f": {ops(symbolic)}"


def test_reshape_minus_one_on_symbol(tmp_path):
    with pytest.raises(tract.TractError, match="should be equal"):
        load(tmp_path, """
            graph G(x) -> (y) {
                x = external<scalar>(shape = [S, 3]);
                y = reshape(x, shape = [-1, 4], axis_start = 0, axis_count = 1);
            }
            """)
        pytest.fail(fixed(tq.RESHAPE_MINUS_ONE_ON_SYMBOL))


def test_symbolic_min_max_not_simplified(tmp_path):
    model = load(tmp_path, """
        graph G(x) -> (y) {
            x = external<scalar>(shape = [B, 3]);
            n = squeeze(slice(tract_core_shape_of(x), axes = [0], begin = [0], end = [1]), axes = [0]);
            y = slice(x, axes = [0], begin = [0], end = [min(n, 1)]);
        }
        """)
    assert str(model.output_fact(0)).startswith("min(B,1),"), (
        fixed(tq.SYMBOLIC_MIN_MAX_NOT_SIMPLIFIED) + f": {model.output_fact(0)}")


def test_pool_needs_static_channels(tmp_path):
    graph = """
        graph G(x) -> (y) {
            x = external<scalar>(shape = SHAPE);
            y = max_pool(x, size = [1, 1, 3], stride = [1, 1, 1], border = 'ignore',
                         padding = [(0, 0), (0, 0), (2, 0)]);
        }
        """
    load(tmp_path / "static", graph.replace("SHAPE", "[1, 4, S]"))
    with pytest.raises(tract.TractError, match="Undetermined symbol"):
        load(tmp_path / "symbolic", graph.replace("SHAPE", "[1, S, 8]"))
        pytest.fail(fixed(tq.POOL_NEEDS_STATIC_CHANNELS))


# --- tract's optimizer -------------------------------------------------------------------------------
def matmul_nodes(tmp_path: Path, body: str, width: int) -> list[dict]:
    return [n for n in nodes(load(tmp_path, f"""
        graph G(a, b, w) -> (y) {{
            a = external<scalar>(shape = [16, {width}]);
            b = external<scalar>(shape = [16, {width}]);
            w = external<scalar>(shape = [32, 32]);
            {body}
        }}
        """).into_runnable()) if n["op_name"] == "OptMatMul"]


def test_slices_pushed_into_matmuls(tmp_path):
    found = matmul_nodes(tmp_path, "m = matmul(a, w); y = add(slice(m, axes = [0], begin = [0], end = [8]), "
                                   "slice(m, axes = [0], begin = [8], end = [16]));", 32)
    assert len(found) >= 2, fixed(tq.SLICES_PUSHED_INTO_MATMULS) + f": {[n['node_name'] for n in found]}"


def test_matmul_of_concat_split(tmp_path):
    found = matmul_nodes(tmp_path, "y = matmul(concat([a, b], axis = 1), w);", 16)
    assert len(found) >= 2 and any("concat-einsum" in n["node_name"] for n in found), (
        fixed(tq.MATMUL_OF_CONCAT_SPLIT) + f": {[n['node_name'] for n in found]}")



def test_const_fold_refuses_a_growing_pad(tmp_path):
    """pad of an 8 MiB variable stays a Pad node; the same pad of half its rows (no larger than the variable) is
    folded into a constant, which is what widened_stack's pieces rely on."""
    from gdn_export.hf.tensors import write_nnef_array

    tmp_path.mkdir(exist_ok=True)
    with (tmp_path / "w.dat").open("wb") as file:
        write_nnef_array(file, np.ones((2048, 1024), np.float32))

    def ops(padded: str) -> list[str]:
        return [n["op_name"] for n in nodes(load(tmp_path, f"""
            graph G(x) -> (y) {{
                x = external<scalar>(shape = [1, 1088]);
                w = variable<scalar>(label = 'w', shape = [2048, 1024]);
                p = pad({padded}, padding = [(0, 0), (0, 64)], border = 'constant', value = 0.0);
                y = add(x, slice(p, axes = [0], begin = [0], end = [1]));
            }}
            """).into_runnable())]

    assert "Pad" in ops("w"), fixed(tq.CONST_FOLD_NO_GROWTH)
    assert "Pad" not in ops("slice(w, axes = [0], begin = [0], end = [1024])")

def test_equal_constants_merged(tmp_path):
    """An int8 matrix of 8 MiB read by tract_core_einsum_q, beside a table gathered from: with the table's bytes
    equal to the matrix's, the matrix is packed on every call (a pack_a node after optimization); with one byte
    changed, at load (no such node)."""
    from gdn_export.weights import int8

    codes = np.random.default_rng(0).integers(-127, 128, (8192, 1024), dtype=np.int8)

    def packed_per_call(folder: Path, table: np.ndarray) -> bool:
        folder.mkdir(parents=True, exist_ok=True)
        for name, values in (("w", codes), ("t", table)):
            with (folder / f"{name}.dat").open("wb") as file:
                int8.write_header(file, values.shape)
                file.write(values.tobytes())
        runnable = load(folder, """
            graph G(x, ids) -> (y, e) {
                x = external<scalar>(shape = [1, 1024]);
                ids = external<integer>(shape = [1]);
                w = variable<scalar>(label = 'w', shape = [8192, 1024]);
                t = variable<scalar>(label = 't', shape = [8192, 1024]);
                zero = tract_core_cast(0, to = 'i32');
                xq = tract_core_cast(x, to = 'i8');
                y = tract_core_einsum_q([xq, w], expr = 'mk,nk,,,,,,,->mn', acc = 'i32', output = 'i32', bias = zero,
                    a0 = zero, a_scale = 1.0, b0 = zero, b_scale = 1.0, c0 = zero, c_scale = 1.0);
                e = tract_core_gather(t, ids, axis = 0);
            }
            """).into_runnable()
        return any(n["op_name"] == "OptMatMulPack" and n["node_name"].endswith("pack_a") for n in nodes(runnable))

    changed = codes.copy()
    changed[0, 0] ^= 1
    assert packed_per_call(tmp_path / "equal", codes), fixed(tq.EQUAL_CONSTANTS_MERGED)
    assert not packed_per_call(tmp_path / "changed", changed)


# --- operators ---------------------------------------------------------------------------------------
def test_sigmoid_floor(tmp_path):
    runnable = load(tmp_path, "graph G(x) -> (y) {\n    x = external<scalar>(shape = [2]);\n    y = sigmoid(x);\n}\n"
                    ).into_runnable()
    got = runnable.run([np.array([-20.0, -40.0], np.float32)])[0].to_numpy()
    assert got.min() > 1e-7, fixed(tq.SIGMOID_FLOOR) + f": sigmoid(-20, -40) = {got} (true 2.1e-9, 4.2e-18)"


SCATTER = """
    graph G(x, i, u) -> (y) {{
        x = external<scalar>(shape = [2, 4]);
        i = tract_core_external(shape = [2, 2], datum_type = 'i64');
        u = external<scalar>(shape = [2, 2]);
        y = tract_core_scatter_elements(x, i, {source}, axis = {axis});
    }}
    """
SCATTER_RUN = ("runnable.run([np.zeros((2, 4), np.float32), np.array([[0, 3], [1, 2]], np.int64), "
               "np.ones((2, 2), np.float32)])")


def test_scatter_negative_axis_aborts(tmp_path):
    proc = child(tmp_path, SCATTER.format(source="u", axis=-1), SCATTER_RUN, CHILD_SECONDS)
    assert_aborts(proc, "index out of bounds", tq.SCATTER_NEGATIVE_AXIS_ABORTS)


def test_scatter_scalar_source_aborts(tmp_path):
    proc = child(tmp_path, SCATTER.format(source="1.0", axis=1), SCATTER_RUN, CHILD_SECONDS)
    assert_aborts(proc, "index out of bounds", tq.SCATTER_SCALAR_SOURCE_ABORTS)


def test_gather_out_of_range_aborts(tmp_path):
    proc = child(tmp_path, """
        graph G(w, ids) -> (y) {
            w = external<scalar>(shape = [8, 4]);
            ids = tract_core_external(shape = [B, S], datum_type = 'i64');
            y = tract_core_gather(w, ids, axis = 0);
        }
        """, """
        table = np.arange(32, dtype=np.float32).reshape(8, 4)
        wrapped = runnable.run([table, np.array([[0, -1]], np.int64)])[0].to_numpy()
        assert (wrapped[0, 1] == table[7]).all()  # -1 wraps to the last row
        print("WRAPPED", flush=True)
        runnable.run([table, np.array([[0, 8]], np.int64)])  # one past the table
        """, CHILD_SECONDS)
    assert "WRAPPED" in proc.stdout, f"a gather of index -1 no longer reads the last row: {proc.stderr[-800:]}"
    assert_aborts(proc, "out of range", tq.GATHER_OUT_OF_RANGE_ABORTS)


def gdn_graph(width_k: int, width_v: int, dtype: str = "f32", decay_dtype: str = "f32", key_heads: int = 1,
              heads: int = 1) -> str:
    ext = lambda shape, d: f"tract_core_external(shape = {shape}, datum_type = '{d}')"  # noqa: E731
    return f"""
        graph G(q, k, v, g, b, s) -> (y, st) {{
            q = {ext(f"[1, S, {key_heads}, {width_k}]", dtype)};
            k = {ext(f"[1, S, {key_heads}, {width_k}]", dtype)};
            v = {ext(f"[1, S, {heads}, {width_v}]", dtype)};
            g = {ext(f"[1, S, {heads}]", decay_dtype)};
            b = {ext(f"[1, S, {heads}]", dtype)};
            s = {ext(f"[1, {heads}, {width_k}, {width_v}]", "f32")};
            (y, st) = tract_transformers_gdn_recurrent(q, k, v, g, b, s);
        }}
        """


def gdn_inputs(seq, key_heads, heads, width_k, width_v, dtype=np.float32, decay_dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, seq, key_heads, width_k)).astype(dtype)
    k = rng.standard_normal((1, seq, key_heads, width_k)).astype(dtype)
    v = rng.standard_normal((1, seq, heads, width_v)).astype(dtype)
    g = -rng.random((1, seq, heads)).astype(decay_dtype)
    b = rng.random((1, seq, heads)).astype(dtype)
    s = rng.standard_normal((1, heads, width_k, width_v)).astype(np.float32)
    return [q, k, v, g, b, s]


def run_gdn(tmp_path, graph, inputs):
    return [o.to_numpy() for o in load(tmp_path, graph).into_runnable().run(inputs)]


def test_fused_gdn_needs_k_eq_v(tmp_path):
    with pytest.raises(tract.TractError, match="GDN value must be"):
        run_gdn(tmp_path, gdn_graph(16, 8), gdn_inputs(3, 1, 1, 16, 8))
        pytest.fail(fixed(tq.FUSED_GDN_NEEDS_K_EQ_V))


def test_fused_gdn_f32_log_decay(tmp_path):
    run_gdn(tmp_path / "f32", gdn_graph(8, 8, "f16", "f32"), gdn_inputs(3, 1, 1, 8, 8, np.float16, np.float32))
    with pytest.raises(tract.TractError, match="unsupported GDN dtype combination"):
        run_gdn(tmp_path / "f16", gdn_graph(8, 8, "f16", "f16"), gdn_inputs(3, 1, 1, 8, 8, np.float16, np.float16))
        pytest.fail(fixed(tq.FUSED_GDN_F32_LOG_DECAY))


def test_fused_gdn_semantics(tmp_path):
    q, k, v, g, b, s = inputs = gdn_inputs(5, 2, 4, 8, 8)
    y, state = run_gdn(tmp_path, gdn_graph(8, 8, key_heads=2, heads=4), inputs)

    def l2norm(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    qn, kn = (np.repeat(l2norm(x.astype(np.float64)), 2, axis=2) for x in (q, k))  # repeat_interleave 2 -> 4
    qn = qn / np.sqrt(8)
    ref, outputs = s.astype(np.float64), []
    for t in range(q.shape[1]):
        ref = ref * np.exp(g[:, t])[..., None, None]
        recalled = np.einsum("bhkv,bhk->bhv", ref, kn[:, t])
        ref = ref + np.einsum("bhk,bhv->bhkv", kn[:, t], (v[:, t] - recalled) * b[:, t, :, None])
        outputs.append(np.einsum("bhkv,bhk->bhv", ref, qn[:, t]))
    error = max(np.abs(y - np.stack(outputs, 1)).max(), np.abs(state - ref).max())
    assert error < 1e-4, ("tract_transformers_gdn_recurrent no longer computes l2-normalized, 1/sqrt(K)-scaled GDN "
                          f"with repeat_interleaved key heads (max error {error:.2e}): "
                          + fixed(tq.FUSED_GDN_SEMANTICS))


def test_causal_conv_semantics(tmp_path):
    runnable = load(tmp_path, """
        graph G(x, w, s) -> (y, st) {
            x = external<scalar>(shape = [1, 4, S]);
            w = external<scalar>(shape = [4, 3]);
            s = external<scalar>(shape = [1, 4, 3]);
            (y, st) = tract_transformers_causal_conv1d_update(x, w, s);
        }
        """).into_runnable()
    rng = np.random.default_rng(0)
    x, w, s = (rng.standard_normal(shape).astype(np.float32) for shape in ((1, 4, 5), (4, 3), (1, 4, 3)))
    y, state = (o.to_numpy() for o in runnable.run([x, w, s]))
    full = np.concatenate([s, x], axis=2)
    conv = sum(w[None, :, i, None] * full[:, :, 1 + i:1 + i + 5] for i in range(3))
    error = max(np.abs(y - conv / (1 + np.exp(-conv))).max(), np.abs(state - full[:, :, -3:]).max())
    assert error < 1e-5, f"causal_conv1d_update changed its function (max error {error:.2e}): " + fixed(
        tq.CAUSAL_CONV_SEMANTICS)


def test_cuda_empty_tensors(tmp_path):
    try:
        runtime = tract.runtime_for_name("cuda")
    except tract.TractError:
        pytest.skip("no CUDA runtime here (checked on an H200 with tract 0.23.9 for this entry)")
    model = load(tmp_path, "graph G(x) -> (y) {\n    x = external<scalar>(shape = [S, 4]);\n    y = neg(x);\n}\n")
    with pytest.raises(tract.TractError, match="CudaNeg"):
        runtime.prepare(model).run([np.ones((0, 4), np.float32)])
        pytest.fail(fixed(tq.CUDA_EMPTY_TENSORS))


# --- torch-to-nnef -----------------------------------------------------------------------------------
def test_t2n_target_downloads_tract(monkeypatch):
    from torch_to_nnef.inference_target.tract import TractCli, TractNNEF

    class Downloaded(Exception):
        pass

    def download(cls, version):
        raise Downloaded(version)

    monkeypatch.setattr(TractCli, "download", classmethod(download))
    with pytest.raises(Downloaded):
        TractNNEF("0.23.9", check_io=False)
        pytest.fail(fixed(tq.T2N_TARGET_DOWNLOADS_TRACT))


def test_t2n_registry_refuses_second_handler():
    from torch_to_nnef.op import extras
    from torch_to_nnef.op.gated_delta import native_gdn_reject_reason

    from gdn_export.backends.nnef.target import OfflineTractTarget

    registry = type(extras._T2N_EXTRA_REGISTRY)(torch_mod_id="gdn_export_canary")  # not the real one
    registry.register(["probe"])(lambda *args, **kwargs: None)
    with pytest.raises(AssertionError, match="already in registry"):
        registry.register(["probe"])(lambda *args, **kwargs: None)
        pytest.fail(fixed(tq.T2N_REGISTRY_REFUSES_SECOND_HANDLER))
    target = OfflineTractTarget("0.23.9", dynamic_axes={"q": {1: "S"}})
    target.native_gated_delta_op = True
    reason = native_gdn_reject_reason(target, (), head_major=True)
    assert reason and "dynamic_axes" in reason, (
        f"torch-to-nnef's fused-op rule accepts dynamic axes now ({reason!r}): its handler may no longer be stale; "
        + fixed(tq.T2N_REGISTRY_REFUSES_SECOND_HANDLER))
