"""The streamed MindIR writer (graphconv/runtime/mindir_stream.py) against what mindspore.export writes.

mindspore.export splits the weights off into <name>_variables/data_0 only past 1 GiB (TOTAL_SAVE); the
children here lower that threshold to 0, so the same small networks are written both ways and compared: the
graphs (normalized for what differs between two runs of mindspore.export itself), the weight bytes, and the
outputs of both MindIRs loaded with mindspore.load and run through nn.GraphCell at two shapes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest

import graphconv
from graphconv.frontend import param_names
from graphconv.frontend.load import load
from graphconv.compiler import export_task, layers
from graphconv.runtime import mindir_stream
from graphconv.runtime.child import child_env
from graphconv.verify import census
from models import EXAMPLES_DIR

# One export in a fresh process (so both ways see the same graph ids), mindspore.export's split forced.
_EXPORT = textwrap.dedent("""
    import json, sys
    from mindspore.train import serialization
    serialization.TOTAL_SAVE = 0
    from graphconv.runtime import export_tasks
    print("RESULT " + json.dumps(export_tasks.export(json.load(open(sys.argv[1])))))
""")

# Load each MindIR and run the cases through GraphCell (graphconv's own run task: dynamic set_inputs).
_RUN = textwrap.dedent("""
    import json, sys
    from graphconv.runtime import run_tasks
    for task in json.load(open(sys.argv[1])):
        run_tasks.run_mindir(task)
    print("RESULT {}")
""")


def _child(script: str, arg: Path, cwd: Path) -> dict:
    path = cwd / f"child_{abs(hash(script))}.py"  # a file: MindSpore parses a Cell's construct from its source
    path.write_text(script)
    done = subprocess.run([sys.executable, str(path), str(arg)], cwd=cwd, env=child_env(), capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _normalized(graph_file: Path):
    """mindir_stream.comparable, after checking each weight points into the MindIR's own _variables/data_0."""
    for p in census.mind_ir_pb2().ModelProto.FromString(graph_file.read_bytes()).graph.parameter:
        assert p.external_data.location == graph_file.name.replace("_graph.mindir", "_variables/data_0")
    return mindir_stream.comparable(graph_file)


@pytest.fixture(scope="module")
def tiny_llama_task(tmp_path_factory):
    """The shipped tiny Llama with its weights external (as large models arrive), lowered with its layer
    Cells; the export task export_task.prepare writes for it."""
    d = tmp_path_factory.mktemp("stream")
    onnx.save(onnx.load(EXAMPLES_DIR / "tiny_llama.onnx"), d / "model.onnx", save_as_external_data=True,
              location="model.onnx.data", size_threshold=1024)
    loaded = load(d / "model.onnx")
    model = onnx.shape_inference.infer_shapes(loaded.proto, data_prop=True)
    net, task = export_task.prepare(model, d, "network", names=param_names.WeightNames.record(loaded.proto),
                             scopes=layers.record_scopes(loaded.proto))
    return d, net, task


def test_streamed_mindir_is_what_mindspore_export_writes(tiny_llama_task):
    d, net, task = tiny_llama_task
    assert task["streamed"] is False  # 0.3 MB: under export_task.STREAM_MIN_BYTES, the compile keeps mindspore.export
    assert sum(p.transposed for p in net.params) >= 10 and net.layers["grouped"] == 2  # Linear layouts, layer Cells
    results = {}
    for way in ("exported", "streamed"):
        (d / way).mkdir()
        t = {**task, "file_base": str(d / way / "net"), "checkpoint": None, "streamed": way == "streamed"}
        (d / f"{way}.json").write_text(json.dumps(t))
        results[way] = _child(_EXPORT, d / f"{way}.json", d)
    assert results["streamed"].get("streamed") and "streamed" not in results["exported"]
    for way in results:
        assert sorted(p.name for p in (d / way).iterdir()) == ["net_graph.mindir", "net_variables"]
        assert sorted(p.name for p in (d / way / "net_variables").iterdir()) == ["data_0"]
    # the weights: byte for byte (header, order, alignment, Linear layouts)
    assert (d / "streamed/net_variables/data_0").read_bytes() == (d / "exported/net_variables/data_0").read_bytes()
    # the graph: the same protobuf, offsets and lengths included
    a, b = _normalized(d / "exported/net_graph.mindir"), _normalized(d / "streamed/net_graph.mindir")
    assert len(a.graph.parameter) == len(net.params) and len(a.functions) >= 1  # the lazy_inline layer graph
    assert a.SerializeToString() == b.SerializeToString()

    # both load and give the same outputs at two shapes
    runs = []
    for k, (batch, seq) in enumerate(((1, 5), (2, 11))):
        case = d / f"case{k}.npz"
        np.savez(case, **{s["name"]: np.random.default_rng(k).integers(0, 100, (batch, seq)).astype(np.int64)
                          for s in task["inputs"]})
        runs.append(case)
    names = [s["name"] for s in task["inputs"]]
    tasks = [{"mindir": str(d / way / "net_graph.mindir"), "cases": [str(c) for c in runs], "input_names": names,
              "outputs": [str(d / f"{way}.out{k}.npz") for k in range(len(runs))], "inputs": task["inputs"]}
             for way in ("exported", "streamed")]
    (d / "run.json").write_text(json.dumps(tasks))
    _child(_RUN, d / "run.json", d)
    for k in range(len(runs)):
        with np.load(d / f"exported.out{k}.npz") as x, np.load(d / f"streamed.out{k}.npz") as y:
            assert x.files == y.files and x["out0"].shape[:2] == ((1, 5), (2, 11))[k]
            assert np.abs(x["out0"]).max() > 0  # real weights, not the lazy zeros
            for f in x.files:
                assert np.array_equal(x[f], y[f])


# A hand-written Cell whose Parameters are casts and transposes of fp32 sources: written by mindspore.export
# from the converted arrays, and streamed from the fp32 file in small chunks (many blocks per weight).
_CASTS = textwrap.dedent("""
    import json, sys
    import numpy as np
    import mindspore as ms
    from mindspore import nn, ops, Parameter, Tensor
    from mindspore.train import serialization
    from graphconv.runtime import mindir_stream
    serialization.TOTAL_SAVE = 0
    ms.set_device("CPU"); ms.set_context(mode=ms.GRAPH_MODE)
    spec = json.load(open(sys.argv[1]))
    DT = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16, "int64": ms.int64}

    class Net(nn.Cell):
        def __init__(self, make):
            super().__init__()
            for p in spec["params"]:
                setattr(self, p["attr"], make(p))
        def construct(self, x):
            y = ops.dense(x, self.w_fp16_t.astype(ms.float32)) + self.b_bf16.astype(ms.float32)
            y = y + ops.dense(x, self.w_bf16_t.astype(ms.float32)) + ops.dense(x, self.w_fp32_t)
            y = y * self.scale_fp16.astype(ms.float32) + self.table.astype(ms.float32).sum() + self.small.sum()
            y = y + ops.dense(x, self.w_wide_t.astype(ms.float32)).sum(-1, keepdims=True)
            return y

    def expected(p):
        a = np.load(spec["arrays"])[p["attr"]]
        return mindir_stream._cast(a.T if p["transposed"] else a, mindir_stream.numpy_dtype(p["dtype"]))

    exported = Net(lambda p: Parameter(Tensor(np.ascontiguousarray(expected(p))), name=p["name"],
                                       requires_grad=p["dtype"] != "int64"))
    exported.set_train(False)
    x = Tensor(shape=[None, spec["n_in"]], dtype=ms.float32)
    ms.export(exported, x, file_name=spec["dir"] + "/exported/net", file_format="MINDIR")
    lazy = mindir_stream.LazyWeights({p["name"]: (p["shape"], p["dtype"]) for p in spec["params"]})
    streamed = Net(lambda p: lazy[p["name"]])
    streamed.set_train(False)
    sources = {n: mindir_stream.Source.of_ref(r) if isinstance(r, list) else
               mindir_stream.Source.of_array(np.load(spec["arrays"])[r]) for n, r in spec["sources"].items()}
    layouts = {p["name"]: p["transposed"] for p in spec["params"]}
    mindir_stream.write(streamed, [x], spec["dir"] + "/streamed/net", sources, layouts, chunk_bytes=200)
    outs = {}
    for way in ("exported", "streamed"):
        cell = nn.GraphCell(ms.load(spec["dir"] + f"/{way}/net_graph.mindir"))
        cell.set_inputs(x)
        for k, rows in enumerate((3, 7)):
            inp = np.random.default_rng(k).standard_normal((rows, spec["n_in"])).astype(np.float32)
            outs[f"{way}{k}"] = cell(Tensor(inp)).asnumpy()
    np.savez(spec["dir"] + "/outs.npz", **outs)
    print("RESULT {}")
""")


def test_casts_and_transposes_are_applied_on_the_way(tmp_path):
    rng = np.random.default_rng(0)
    n_in, n_out = 37, 29  # odd sizes: blocks end mid-row, segments are not aligned; rows > cols: by row blocks
    params = [("w_fp16_t", "layer.w16", (n_in, n_out), "float16", True),
              ("w_bf16_t", "layer.wbf", (n_in, n_out), "bfloat16", True),
              ("w_fp32_t", "layer.w32", (n_in, n_out), "float32", True),
              ("w_wide_t", "layer.wide", (n_in, 61), "float16", True),  # rows < cols: written by column strips
              ("b_bf16", "layer.b", (n_out,), "bfloat16", False),
              ("scale_fp16", "layer.s", (n_out,), "float16", False),
              ("table", "emb", (13, 5), "int64", False),
              ("small", "folded", (3, 3), "float32", False)]
    arrays, sources = {}, {}
    data = tmp_path / "weights.bin"
    with open(data, "wb") as f:
        for attr, name, shape, dtype, _ in params:
            a = (rng.integers(-5, 5, shape) if dtype == "int64" else rng.standard_normal(shape) * 3).astype(
                np.int64 if dtype == "int64" else np.float32)
            arrays[attr] = a
            if attr == "small":
                sources[name] = attr  # an in-memory source
                continue
            f.write(b"\0" * 7)  # sources at odd offsets
            sources[name] = [str(data), f.tell(), a.nbytes, a.dtype.name, list(shape)]
            f.write(a.tobytes())
    np.savez(tmp_path / "arrays.npz", **arrays)
    (tmp_path / "exported").mkdir()
    spec = {"dir": str(tmp_path), "n_in": n_in, "arrays": str(tmp_path / "arrays.npz"), "sources": sources,
            "params": [{"attr": a, "name": n, "shape": list(s[::-1] if t else s), "dtype": dt, "transposed": t}
                       for a, n, s, dt, t in params]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    _child(_CASTS, tmp_path / "spec.json", tmp_path)
    assert (tmp_path / "streamed/net_variables/data_0").read_bytes() == \
        (tmp_path / "exported/net_variables/data_0").read_bytes()
    graphs = {w: census.mind_ir_pb2().ModelProto.FromString((tmp_path / w / "net_graph.mindir").read_bytes())
              for w in ("exported", "streamed")}
    def entry(p):  # (both written by one process: the graph ids in the names differ)
        return mindir_stream.parameter_name(p.name), p.dims, p.data_type, p.external_data.offset, p.external_data.length

    assert [entry(p) for p in graphs["exported"].graph.parameter] == \
        [entry(p) for p in graphs["streamed"].graph.parameter]
    with np.load(tmp_path / "outs.npz") as outs:
        for k in range(2):
            assert np.array_equal(outs[f"exported{k}"], outs[f"streamed{k}"]) and np.abs(outs[f"streamed{k}"]).max() > 0


def _graph(params):
    """A weightless ModelProto with these (name, dims, mind_ir data type) parameters."""
    model = census.mind_ir_pb2().ModelProto()
    for name, dims, dtype in params:
        model.graph.parameter.add(name=f"7_graph:{name}", dims=dims, data_type=dtype)
    return model


def test_layout_and_bounded_chunks(tmp_path):
    """Without MindSpore: the data_0 layout (header, name order, 64-byte alignment), the same bytes for any
    chunk size, and one-line errors for a weight that does not fit its declaration."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((300, 7)).astype(np.float32)  # rows > cols: transposed by row blocks
    u = rng.standard_normal((9, 50)).astype(np.float32)  # rows < cols: by column strips
    v = rng.standard_normal(5).astype(np.float32)
    src = tmp_path / "src.bin"
    src.write_bytes(w.tobytes() + v.tobytes() + u.tobytes())
    sources = {"z.w": mindir_stream.Source((300, 7), "float32", str(src), 0, w.nbytes),
               "a.v": mindir_stream.Source((5,), "float32", str(src), w.nbytes, v.nbytes),
               "m.u": mindir_stream.Source((9, 50), "float32", str(src), w.nbytes + v.nbytes, u.nbytes)}
    files = []
    for chunk in (4, 100, 1 << 20):
        model = _graph([("z.w", [7, 300], 10), ("a.v", [5], 1), ("m.u", [50, 9], 16)])  # fp16, fp32, bf16
        folder = mindir_stream.write_weights(model, tmp_path / f"c{chunk}", "m", sources, {"z.w": True, "m.u": True},
                                             chunk)
        files.append((folder / "data_0").read_bytes())
    assert files[0] == files[1] == files[2]
    data = files[0]
    assert data[:64] == b"\x01" + bytes(63)
    by_name = {mindir_stream.parameter_name(p.name): p.external_data for p in model.graph.parameter}
    assert (by_name["a.v"].offset, by_name["a.v"].length) == (64, 20)  # sorted by name: a.v first
    assert (by_name["m.u"].offset, by_name["m.u"].length) == (128, 50 * 9 * 2)  # 20 padded to 64
    assert (by_name["z.w"].offset, by_name["z.w"].length) == (1088, 7 * 300 * 2)  # 900 padded to 960
    assert by_name["z.w"].location == "m_variables/data_0"
    assert len(data) == 1088 + 4224  # 4200 padded to 64
    import ml_dtypes

    got = np.frombuffer(data[128:1028], ml_dtypes.bfloat16).reshape(50, 9)
    assert np.array_equal(got, u.T.astype(ml_dtypes.bfloat16)) and data[1028:1088] == bytes(60)
    got = np.frombuffer(data[1088:1088 + 4200], np.float16).reshape(7, 300)
    assert np.array_equal(got, w.T.astype(np.float16))
    assert np.array_equal(np.frombuffer(data[64:84], np.float32), v) and data[84:128] == bytes(44)

    with pytest.raises(mindir_stream.StreamError, match=r"'z.w': the graph declares \[300, 7\], the source gives"):
        mindir_stream.write_weights(_graph([("z.w", [300, 7], 1)]), tmp_path / "e1", "m", sources, {"z.w": True})
    with pytest.raises(mindir_stream.StreamError, match="no values for parameter 'q'"):
        mindir_stream.write_weights(_graph([("q", [2], 1)]), tmp_path / "e2", "m", sources)
    with pytest.raises(mindir_stream.StreamError, match="cannot convert float32 to int64"):
        mindir_stream.write_weights(_graph([("a.v", [5], 7)]), tmp_path / "e3", "m", sources)


def test_weights_put_in_any_order_give_the_same_file(tmp_path, monkeypatch):
    """WeightsFile.put (a weight's final array, as a layer-streamed run holds it) in any order, the rest by
    finish from the sources: the same bytes as write_weights. A put in another layout or dtype than the graph
    declares is refused (returns False) and that weight is written from its source; a failed background write
    is raised by finish as a StreamError."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((30, 7)).astype(np.float32)
    v = rng.standard_normal(5).astype(np.float32)
    src = tmp_path / "src.bin"
    src.write_bytes(w.tobytes() + v.tobytes())
    sources = {"z.w": mindir_stream.Source((30, 7), "float32", str(src), 0, w.nbytes),
               "a.v": mindir_stream.Source((5,), "float32", str(src), w.nbytes, v.nbytes)}
    declared = [("z.w", [7, 30], 1), ("a.v", [5], 1)]
    expected = (mindir_stream.write_weights(_graph(declared), tmp_path / "ref", "m", sources, {"z.w": True})
                / "data_0").read_bytes()

    def written(puts):
        out = tmp_path / f"p{len(list(tmp_path.iterdir()))}"
        wf = mindir_stream.WeightsFile(_graph(declared), out, "m", sources, {"z.w": True})
        accepted = [wf.put(name, value, transposed) for name, value, transposed in puts]
        return accepted, (wf.finish() / "data_0").read_bytes(), wf.put_bytes

    assert written([("z.w", np.ascontiguousarray(w.T), True), ("a.v", v, False)]) == ([True, True], expected, 840 + 20)
    assert written([("a.v", v, False)]) == ([True], expected, 20)
    assert written([("a.v", v, False), ("a.v", v * 0, False)]) == ([True, False], expected, 20)  # once only
    refused = [("z.w", w, False), ("z.w", w.T.astype(np.float16), True), ("a.v", v[:4], False), ("q", v, False)]
    assert written(refused) == ([False] * 4, expected, 0)

    def broken(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mindir_stream, "_pwrite_all", broken)
    wf = mindir_stream.WeightsFile(_graph(declared), tmp_path / "full", "m", sources, {"z.w": True})
    wf.put("a.v", v, False)
    with pytest.raises(mindir_stream.StreamError, match="writing the MindIR's weights failed: .*No space left"):
        wf.finish()


def test_zeros_never_written_go_last_unwritten_and_strip_by_truncating(tmp_path):
    """A source that is a hole of its file (SpillFile.zeros: a KV cache's initial value) is laid out after the
    other Parameters and never written, nor taken by put (a layer-streamed run's cache holds what its calls
    wrote); stripping it (mindir_state.strip) truncates the file, the other weights untouched."""
    import onnx

    from graphconv.frontend import weights
    from graphconv.runtime import mindir_state

    rng = np.random.default_rng(3)
    v = rng.standard_normal(5).astype(np.float32)
    spill = weights.SpillFile(tmp_path / "spill.bin")
    refs = {"cache.k": weights.weight_ref(spill.zeros("cache.k", onnx.TensorProto.FLOAT, [64, 1024])),
            "w.v": weights.weight_ref(spill.tensor_proto("w.v", v)),
            "aa.zeros_written": weights.weight_ref(spill.tensor_proto("aa", np.zeros(16, np.float32)))}
    assert [weights.is_zeros(r) for r in refs.values()] == [True, False, False]  # (written zeros are data)
    assert np.array_equal(weights.read(refs["cache.k"]), np.zeros((64, 1024), np.float32))
    sources = {name: mindir_stream.Source.of_ref(r) for name, r in refs.items()}
    model = _graph([("cache.k", [64, 1024], 1), ("w.v", [5], 1), ("aa.zeros_written", [16], 1)])
    wf = mindir_stream.WeightsFile(model, tmp_path, "m", sources)
    assert not wf.put("cache.k", np.ones((64, 1024), np.float32), False)
    data_file = wf.finish() / "data_0"
    at = {mindir_stream.parameter_name(p.name): (p.external_data.offset, p.external_data.length)
          for p in model.graph.parameter}
    assert at == {"aa.zeros_written": (64, 64), "w.v": (128, 20), "cache.k": (192, 64 * 1024 * 4)}  # zeros last
    assert data_file.stat().st_size == 192 + 64 * 1024 * 4 and data_file.stat().st_blocks * 512 < 64 * 1024
    data = data_file.read_bytes()
    assert np.array_equal(np.frombuffer(data[128:148], np.float32), v) and not any(data[192:])

    graph_file = tmp_path / "m_graph.mindir"
    graph_file.write_bytes(model.SerializeToString())
    assert mindir_state.strip(graph_file, "cache.") == {"cache.k": {"shape": [64, 1024], "dtype": "float32"}}
    assert data_file.read_bytes() == data[:192]  # truncated; the others where they were
    kept = census.mind_ir_pb2().ModelProto.FromString(graph_file.read_bytes())
    assert {mindir_stream.parameter_name(p.name): (p.external_data.offset, p.external_data.length)
            for p in kept.graph.parameter if p.HasField("external_data")} == {"aa.zeros_written": (64, 64),
                                                                            "w.v": (128, 20)}


@pytest.fixture
def external_llama(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    onnx.save(onnx.load(EXAMPLES_DIR / "tiny_llama.onnx"), d / "model.onnx", save_as_external_data=True,
              location="model.onnx.data", size_threshold=1024)
    return d / "model.onnx"


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("flip", [False, True])
def test_concatenated_sources_are_written_from_their_parts(tmp_path, axis, flip):
    """Without MindSpore: a weight that is two others concatenated (a merged gate/up weight, which the spill
    writes nowhere) is written from its parts, at any chunk size, as the concatenation itself is written
    (one after the other where the target holds them so: axis 0, or axis 1 transposed; else made whole);
    fp32 sources into an fp16 Parameter."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal((6, 10)).astype(np.float32)
    b = rng.standard_normal((6, 10) if axis == 1 else (4, 10)).astype(np.float32)
    src = tmp_path / "src.bin"
    src.write_bytes(b"\0" * 3 + a.tobytes() + b.tobytes())
    parts = (mindir_stream.Source(a.shape, "float32", str(src), 3, a.nbytes),
             mindir_stream.Source(b.shape, "float32", str(src), 3 + a.nbytes, b.nbytes))
    whole = np.concatenate([a, b], axis=axis)
    concatenated = mindir_stream.Source(whole.shape, "float32", str(tmp_path / "nothing.bin"), 0, whole.nbytes,
                                        parts=parts, axis=axis)
    assert np.array_equal(concatenated.read(), whole) and concatenated.files() == list(parts)
    dims = list(whole.shape[::-1] if flip else whole.shape)
    files = []
    for chunk in (8, 1 << 20):
        for name, source in (("w", concatenated), ("w", mindir_stream.Source.of_array(whole))):
            folder = mindir_stream.write_weights(_graph([(name, dims, 10)]), tmp_path / f"c{chunk}{len(files)}", "m",
                                                 {name: source}, {name: flip}, chunk)
            files.append((folder / "data_0").read_bytes())
    assert len(set(files)) == 1
    got = np.frombuffer(files[0][64:64 + whole.size * 2], np.float16).reshape(dims)
    assert np.array_equal(got, (whole.T if flip else whole).astype(np.float16))


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_read_transposed_is_the_transpose_of_read(tmp_path, axis, dtype):
    """Source.read_transposed (the layer-streamed run's prefetch): read().T, tiles copied from a memory map of
    the file at an unaligned offset, over edges that are no multiple of the 128-tile, and a merged weight's
    parts each into their own rows (axis 1) or columns (axis 0) of the transpose."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((300, 200)).astype(dtype)
    b = rng.standard_normal((300, 70) if axis % 2 else (130, 200)).astype(dtype)
    src = tmp_path / "src.bin"
    src.write_bytes(b"\0" * 5 + a.tobytes() + b.tobytes())
    parts = (mindir_stream.Source(a.shape, dtype, str(src), 5, a.nbytes),
             mindir_stream.Source(b.shape, dtype, str(src), 5 + a.nbytes, b.nbytes))
    whole = np.concatenate([a, b], axis=axis)
    merged = mindir_stream.Source(whole.shape, dtype, str(tmp_path / "nothing.bin"), 0, whole.nbytes, parts=parts,
                                  axis=axis)
    for source, want in ((parts[0], a), (merged, whole), (mindir_stream.Source.of_array(b), b)):
        got = source.read_transposed()
        assert got.flags.c_contiguous and got.dtype == want.dtype
        assert np.array_equal(got, want.T) and np.array_equal(got, source.read().T)


@pytest.mark.parametrize("target", ["ascend", "cpu"])
def test_compile_streams_large_external_weights(external_llama, tmp_path, monkeypatch, target):
    """The compile takes the streamed writer for external weights past export_task.STREAM_MIN_BYTES (lowered so the
    tiny model qualifies): it verifies (ascend: on the cpu twin, which reads its own weights; cpu: on the
    MindIR itself), and the artifacts are those of mindspore.export's split layout."""
    monkeypatch.setattr(export_task, "STREAM_MIN_BYTES", 0)
    out = tmp_path / "out"
    out.mkdir()
    report = graphconv.compile(external_llama, out / "m.mindir", target=target, report_path=out / "r.json")
    assert report.status == "verified"
    stages = {s["name"]: s for s in json.loads((out / "r.json").read_text())["stages"]}
    assert stages["emit"]["detail"]["streamed"] is True
    assert sorted(p.name for p in out.iterdir()) == ["m.mindir", "m_variables", "r.json"]


@pytest.mark.parametrize("target", ["ascend", "cpu"])
def test_layer_streamed_run_writes_the_weights_it_holds(external_llama, tmp_path, monkeypatch, target):
    """A streamed export verified layer by layer takes each weight from the block Parameters that already
    hold it (mindir_stream.WeightsFile.put: read and transposed once for both): the MindIR is byte for byte
    the one written from the files alone, and it is every weight of the network. With the merged gate/up
    weights made from their parts (weights.SPILL_MIN_BYTES lowered: the tiny model's qualify), both ways
    give the file again: the same bytes as when the merged weights were in memory."""
    from graphconv.frontend import weights

    monkeypatch.setattr(export_task, "STREAM_MIN_BYTES", 0)
    reports, data, graphs, put = {}, {}, {}, {}
    for merged_from_parts in (False, True):
        if merged_from_parts:
            monkeypatch.setattr(weights, "SPILL_MIN_BYTES", 4096)
        for mode in (False, True):
            key = (merged_from_parts, mode)
            out = tmp_path / f"out_{merged_from_parts}_{mode}"
            out.mkdir()
            report = graphconv.compile(external_llama, out / "m.mindir", target=target, report_path=out / "r.json",
                                       layer_streamed=mode)
            assert report.status == "verified"
            reports[key] = {s["name"]: s for s in json.loads((out / "r.json").read_text())["stages"]}
            data[key] = (out / "m_variables" / "data_0").read_bytes()
            graphs[key] = mindir_stream.comparable(out / "m.mindir")
            put[key] = sum(p.external_data.length for p in graphs[key].graph.parameter)
    assert reports[True, True]["passes"]["detail"]["concatenated_bytes"] == 2 * 64 * 256 * 4
    assert reports[False, True]["passes"]["detail"]["concatenated_bytes"] == 0
    for key in [(False, True), (True, False), (True, True)]:
        assert data[key] == data[False, False], key
        assert graphs[key] == graphs[False, False], key
    for merged_from_parts in (False, True):
        detail = {mode: reports[merged_from_parts, mode]["emit"]["detail"] for mode in (False, True)}
        assert "weights_put_by_verification_bytes" not in detail[False]
        assert detail[True]["weights_put_by_verification_bytes"] == put[merged_from_parts, True]


@pytest.mark.parametrize("layer_streamed", [False, True])
def test_streamed_export_writes_the_checkpoint_mindspore_writes(external_llama, tmp_path, monkeypatch,
                                                                layer_streamed):
    """--emit-source of a streamed export: network.ckpt is copied from the MindIR's data file
    (mindir_stream.write_checkpoint), byte for byte the file mindspore.save_checkpoint writes for the
    network built with its weights (the unstreamed export), and mindspore.load_checkpoint reads it back."""
    outs = {}
    for streamed in (False, True):
        monkeypatch.setattr(export_task, "STREAM_MIN_BYTES", 0 if streamed else 1 << 40)
        out = tmp_path / f"out_{streamed}"
        out.mkdir()
        graphconv.compile(external_llama, out / "m.mindir", target="ascend", report_path=out / "r.json",
                          emit_source=out / "src", layer_streamed=layer_streamed)
        emit_stage = next(s for s in json.loads((out / "r.json").read_text())["stages"] if s["name"] == "emit")
        assert emit_stage["detail"].get("streamed", False) is streamed
        outs[streamed] = (out / "src" / "network.ckpt").read_bytes()
    assert len(outs[True]) > 100_000 and outs[True] == outs[False]
    code = textwrap.dedent(f"""
        import mindspore as ms, numpy as np
        a = ms.load_checkpoint({str(tmp_path / "out_True" / "src" / "network.ckpt")!r})
        b = ms.load_checkpoint({str(tmp_path / "out_False" / "src" / "network.ckpt")!r})
        assert sorted(a) == sorted(b) and len(a) > 5
        assert all(np.array_equal(a[k].asnumpy(), b[k].asnumpy()) for k in a)
        print("ok", len(a))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-2000:]


_SLICED_CKPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import numpy as np
    import mindspore as ms
    from mindspore import nn, Parameter, Tensor
    from mindspore.train import serialization
    from graphconv.runtime import mindir_stream
    from graphconv.verify import census
    serialization.SLICE_SIZE = 1  # KiB: Parameters past 1 KiB are written in slices
    mindir_stream.CKPT_SLICE_BYTES = 1024
    rng = np.random.default_rng(0)
    w = rng.standard_normal((300, 7)).astype(np.float32)  # 8,400 bytes: 9 slices
    v = rng.standard_normal(5).astype(np.float16)
    empty = np.zeros((0, 4), np.float32)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(Tensor(np.ascontiguousarray(w.T)), name="z.w")  # stored transposed
            self.v = Parameter(Tensor(v), name="a.v")
            self.e = Parameter(Tensor(empty), name="e")  # not in the graph: made from its source

    tmp = Path(sys.argv[1]).parent
    ms.save_checkpoint(Net(), str(tmp / "ref.ckpt"))
    (tmp / "src.bin").write_bytes(w.tobytes() + v.tobytes())
    sources = {"z.w": mindir_stream.Source((300, 7), "float32", str(tmp / "src.bin"), 0, w.nbytes),
               "a.v": mindir_stream.Source((5,), "float16", str(tmp / "src.bin"), w.nbytes, v.nbytes),
               "e": mindir_stream.Source.of_array(empty)}
    model = census.mind_ir_pb2().ModelProto()
    model.graph.parameter.add(name="1:z.w", dims=[7, 300], data_type=1)
    model.graph.parameter.add(name="1:a.v", dims=[5], data_type=10)
    wf = mindir_stream.WeightsFile(model, tmp / "mindir", "m", sources, {"z.w": True})
    wf.finish()
    params = [("z.w", "float32", (7, 300)), ("a.v", "float16", (5,)), ("e", "float32", (0, 4))]
    mindir_stream.write_checkpoint(tmp / "ours.ckpt", params, wf, {"z.w": True})
    loaded = ms.load_checkpoint(str(tmp / "ours.ckpt"))
    print("RESULT " + json.dumps({"same": (tmp / "ours.ckpt").read_bytes() == (tmp / "ref.ckpt").read_bytes(),
                                  "size": (tmp / "ours.ckpt").stat().st_size, "loaded": sorted(loaded),
                                  "w": bool(np.array_equal(loaded["z.w"].asnumpy(), w.T))}))
""")


def test_checkpoint_slices_are_mindspores(tmp_path):
    """write_checkpoint at a lowered slice size (a Parameter in 9 slices), an fp16 one and an empty one not in
    the graph: byte for byte mindspore.save_checkpoint's file at the same SLICE_SIZE, and it loads."""
    got = _child(_SLICED_CKPT, tmp_path / "arg", tmp_path)
    assert got["same"] and got["size"] > 8400 and got["w"]
    assert got["loaded"] == ["a.v", "z.w"]  # (an empty Parameter writes no value, in both)
