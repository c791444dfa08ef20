"""The fused primitives' documented limits (opmap/fused/record.py's Constraint) and where the compile checks
them: each limit at its documented boundary, the passes reading the declared bounds of symbolic dims
(passes/dim_bounds.py), and --shape-range on a plain compile.

The boundary numbers below are typed from the sources the records name (MindSpore 2.10's docstrings, CANN's
operator pages), not read from the records."""

from __future__ import annotations

import json
import subprocess
import sys

import onnx_ir as ir
import pytest
from click.testing import CliRunner

import opmap  # noqa: F401  (defines every record)
import passes
from graphconv.cli import cli
from opmap.fused.record import FUSED_OPS
from passes import dim_bounds

# (op, constraint text) -> (sizes and attributes where it holds, sizes and attributes where it is broken)
DOCUMENTED = {
    ("RotaryPositionEmbedding", "D even and < 896"): ([{"D": 894}, {"D": 2}], [{"D": 896}, {"D": 63}]),
    ("RotaryPositionEmbedding", "B < 1000"): ([{"B": 999}], [{"B": 1000}]),
    ("RotaryPositionEmbedding", "N < 1000"): ([{"N": 999}], [{"N": 1000}]),
    ("RotaryPositionEmbedding", "B·N < 1000 in mode 1 (interleaved)"): (
        [{"B": 249, "N": 4, "mode": 1}, {"B": 250, "N": 4, "mode": 0}], [{"B": 250, "N": 4, "mode": 1}]),
    ("FlashAttentionScore", "D a multiple of 16 and at most 512"): ([{"D": 16}, {"D": 512}],
                                                                   [{"D": 40}, {"D": 528}]),
    ("FlashAttentionScore", "N1 at most 256"): ([{"N1": 256}], [{"N1": 257}]),
    ("FlashAttentionScore", "N2 a factor of N1"): ([{"N1": 8, "N2": 2}], [{"N1": 8, "N2": 3}]),
    ("FlashAttentionScore", "B at most 2k (read as 2048)"): ([{"B": 2048}], [{"B": 2049}]),
    ("FlashAttentionScore", "S1 at most 512k"): ([{"S1": 524288}], [{"S1": 524289}]),
    ("FlashAttentionScore", "S2 at most 512k"): ([{"S2": 524288}], [{"S2": 524289}]),
    ("FusedInferAttentionScore", "N1/N2 at most 64"): ([{"N1": 64, "N2": 1}, {"N1": 128, "N2": 2}],
                                                      [{"N1": 65, "N2": 1}]),
    ("FusedInferAttentionScore", "B at most 65535"): ([{"B": 65535}], [{"B": 65536}]),
    ("FusedInferAttentionScore", "N1 at most 256"): ([{"N1": 256}], [{"N1": 257}]),
    ("FusedInferAttentionScore", "D at most 512"): ([{"D": 512}], [{"D": 513}]),
    ("FusedInferAttentionScore", "S1 and S2 at most 20M (20971520)"): (
        [{"S1": 1, "S2": 20971520}], [{"S1": 1, "S2": 20971521}, {"S1": 20971521, "S2": 1}]),
    ("MoeGatingTopKSoftmax", "1 <= k <= 1024"): ([{"k": 1}, {"k": 1024}], [{"k": 0}, {"k": 1025}]),
    ("MoeGatingTopKSoftmax", "k at most the experts E"): ([{"k": 8, "E": 8}], [{"k": 9, "E": 8}]),
    ("WeightQuantBatchMatmul", "antiquant_group_size 0 (per channel) or a multiple of 32 in [32, K-1]"): (
        [{"K": 34, "G": 32}, {"K": 128, "G": 64}, {"K": 128, "G": 0}],
        [{"K": 32, "G": 32}, {"K": 128, "G": 48}, {"K": 128, "G": 16}]),
    ("WeightQuantBatchMatmul", "K at most 65535"): ([{"K": 65534}], [{"K": 65536}]),
    ("WeightQuantBatchMatmul", "N at most 65535"): ([{"N": 65535}], [{"N": 65536}]),
    ("WeightQuantBatchMatmul", "K even for 4-bit weights (two int4 per qint4x2 byte)"): (
        [{"K": 64, "bits": 4}, {"K": 65, "bits": 8}], [{"K": 65, "bits": 4}]),
    ("WeightQuantBatchMatmul", "weight_bits 4 (qint4x2) or 8 (int8)"): ([{"bits": 4}, {"bits": 8}], [{"bits": 2}]),
}


def test_every_record_constraint_has_its_documented_boundary_here():
    recorded = {(op.name, c.text) for op in FUSED_OPS.values() for c in op.constraints}
    assert recorded == set(DOCUMENTED)
    assert all(c.source for op in FUSED_OPS.values() for c in op.constraints)


@pytest.mark.parametrize("key", DOCUMENTED, ids=" / ".join)
def test_each_constraint_holds_and_breaks_at_its_documented_boundary(key):
    op = FUSED_OPS[key[0]]
    (constraint,) = [c for c in op.constraints if c.text == key[1]]
    holds, breaks = DOCUMENTED[key]
    for values in holds:
        attrs = {k: v for k, v in values.items() if k == "mode"}
        assert op.broken({k: v for k, v in values.items() if k != "mode"}, attrs) is None, values
    for values in breaks:
        attrs = {k: v for k, v in values.items() if k == "mode"}
        assert op.broken({k: v for k, v in values.items() if k != "mode"}, attrs) is constraint, values
    assert op.broken({}) is None  # an unknown size: not checkable, not broken


def _fuse_attention(model, ranges: dict) -> tuple[int, dict]:
    """fuse-attention alone with the dims' bounds declared as `ranges`: (count, the attention coverage)."""
    m = ir.from_proto(model)
    dim_bounds.declare(m, ranges, {})
    pm = passes.PassManager("fuse-attention")
    return pm.run(m)["fuse-attention"], pm.coverage["attention"]


def test_flash_attention_is_refused_where_the_declared_sequence_range_passes_512k():
    """FlashAttentionScore's S1/S2 at most 512k, checked at a --shape-range maximum of the graph's seq dim."""
    from test_attention_stages import _named
    from test_fuse_attention import _attention_graph

    def run(hi):
        return _fuse_attention(_named(_attention_graph()), {"seq": (1, hi)})

    assert run(524288)[0] == 1
    count, coverage = run(524289)
    assert count == 0 and list(coverage["refused"]) == [
        "FlashAttentionScore needs S1 at most 512k (mindspore 2.10 ops.flash_attention_score docstring) at "
        "S1 up to 524289 (declared range seq=1..524289)"], coverage


@pytest.fixture(scope="module")
def gptj_export(tmp_path_factory):
    """A tiny GPT-J (interleaved rotary on 8 of 16 dims, 4 heads) saved by save_pretrained, exported by
    `graphconv export` as a user does."""
    transformers = pytest.importorskip("transformers")
    import torch

    root = tmp_path_factory.mktemp("gptj")
    torch.manual_seed(0)
    config = transformers.GPTJConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=256, n_positions=128,
                                     bos_token_id=1, eos_token_id=2)
    transformers.GPTJForCausalLM(config).eval().save_pretrained(root / "ckpt")
    result = CliRunner().invoke(cli, ["export", str(root / "ckpt"), "-o", str(root / "exp"), "--task",
                                      "text-generation"])
    assert result.exit_code == 0, result.output
    return root / "exp" / "model.onnx"


@pytest.mark.parametrize("batch, fused", [("1..4", 4), ("1..512", 0)])
def test_gptj_rotary_fuses_within_the_declared_batch_and_is_refused_past_it(gptj_export, tmp_path, batch, fused):
    """The architecture's rotary count is 4 (2 layers × q and k), each of 4 heads in mode 1: B·N < 1000 holds
    for B up to 4 and breaks for B up to 512 (CANN's limit), which the coverage says."""
    result = CliRunner().invoke(cli, ["compile", str(gptj_export), "-o", str(tmp_path / "g.mindir"),
                                      "--shape-range", f"batch={batch}", "--json", "-q"])
    assert result.exit_code == 0, result.output
    coverage = json.loads(result.output)["coverage"]["rotary"]
    assert (coverage["candidates"], coverage["fused"]) == (4, fused), coverage
    if not fused:
        assert coverage["refused"] == {
            "RotaryPositionEmbedding needs B·N < 1000 in mode 1 (interleaved) (CANN's aclnnRotaryPositionEmbedding "
            "page) at B up to 512 (declared range batch=1..512), N=4": 4}


def test_a_shape_range_that_names_no_symbolic_dim_is_a_one_line_error(gptj_export, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "graphconv", "compile", str(gptj_export), "-o",
                           str(tmp_path / "g.mindir"), "--shape-range", "sequence=1..8"],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr == ("graphconv: error: --shape-range names ['sequence'] are not symbolic dims of the model "
                           "(it has ['batch', 'sequence_length'])\n")
    assert list(tmp_path.iterdir()) == []


def test_a_dim_computed_from_a_declared_dim_is_bounded_through_its_expression():
    """Exporters write computed dims as expressions (dynamo's `4*batch` in a Bloom export): here q/k/v's batch is
    `2*half`, and FlashAttentionScore's B at most 2048 holds at half up to 1024 and breaks at 1025."""
    import onnx

    from test_attention_stages import _named
    from test_fuse_attention import _attention_graph

    def run(hi):
        model = _attention_graph()
        for vi in model.graph.input:
            for d in vi.type.tensor_type.shape.dim:
                if d.dim_param == "batch":
                    d.dim_param = "2*half"
        return _fuse_attention(_named(onnx.ModelProto.FromString(model.SerializeToString())), {"half": (1, hi)})

    assert run(1024)[0] == 1
    count, coverage = run(1025)
    assert count == 0 and list(coverage["refused"]) == [
        "FlashAttentionScore needs B at most 2k (read as 2048) (mindspore 2.10 ops.flash_attention_score docstring) "
        "at B up to 2050 (2*half with half up to 1025 (declared range half=1..1025))"], coverage


@pytest.mark.parametrize("dim, largest", [("4*batch", 2048), ("batch - 1", 511), ("batch + seq", 521),
                                          ("((seq**2)//seq)", 9), ("batch//2", 256), ("max(batch, 3)", 512),
                                          ("2 - batch", None), ("(7*batch)//seq", None), ("batch*unk__1", None),
                                          ("unk__1", None)])
def test_expression_bounds(dim, largest):
    """A computed dim is bounded where it cannot decrease as its dims grow (batch up to 512, seq up to 9);
    anything else is unknown, never guessed."""
    m = ir.Model(ir.Graph([], [], nodes=[]), ir_version=10)
    dim_bounds.declare(m, {"batch": (1, 512)}, {"seq": [7, 9]})
    got = dim_bounds.largest(m, ir.Value(shape=ir.Shape([dim])), 0)
    assert (got[0] if got else None) == largest
