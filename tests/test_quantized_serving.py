"""Row-wise quantized tables for serving (int8, int4, int2, and fp16 tables).

References, each independent of the code under test:
- the packed bytes decoded in float64 by ``unpack_float64`` below, written from the layout's
  definition (codes low bits first, then the scale and bias floats), not from the library;
- a float64 DLRM whose tables hold those decoded values: the quantized model's scores must equal
  its scores to float32 rounding, for one-hot ids, multi-hot bags (sum and mean), hashed ids and
  a mix of precisions, through torch's CPU operators (FBGEMM) and through the Triton kernel
  (Triton's interpreter on the CPU here, the GPU on a GPU machine);
- the quantization error bound of row-wise uniform quantization: half a step per value;
- the checkpoint files themselves (a committed row-wise checkpoint, NVIDIA's layout).
"""

import os

import numpy as np
import pytest
import torch

from conftest import REPO
from dlrm.data.batch import Bags
from dlrm.inference.export import build_inference_model, check_export, export_onnx, export_torchscript
from dlrm.inference.quantize import (
    build_quantized_model, quantize_model, serving_report, table_bytes, table_precisions,
)
from dlrm.kernels.quantized_rows import (
    QUANTIZED, dequantize_gather, dequantize_gather_reference, quantize_rows, row_bytes,
    supports_dequantize_gather,
)
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.nn.quantized_embedding import QuantizedEmbedding
from dlrm.training import nvidia_checkpoint
from dlrm.training.checkpoint import TrainState, save_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")
TABLES = [100, 7, 1000, 50]
BITS = {"int8": 8, "int4": 4, "int2": 2}
FIXTURE = os.path.join(REPO, "tests", "fixtures", "checkpoints", "dlrm_row_wise_2_processes")


def unpack_float64(packed: torch.Tensor, dim: int, precision: str) -> torch.Tensor:
    """The layout's definition, plainly: element j is bits [b*(j%k), b*(j%k)+b) of byte j//k
    (k = 8 // b codes a byte), times the row's scale plus its bias (fp32 for int8, else fp16)."""
    bits = BITS[precision]
    per_byte = 8 // bits
    data = packed.numpy()
    scale_type, scale_bytes = (np.float32, 4) if precision == "int8" else (np.float16, 2)
    width = dim // per_byte
    out = np.empty((data.shape[0], dim))
    for r in range(data.shape[0]):
        scale, bias = np.frombuffer(data[r, width:width + 2 * scale_bytes].tobytes(), dtype=scale_type)
        for j in range(dim):
            code = (int(data[r, j // per_byte]) >> (bits * (j % per_byte))) & ((1 << bits) - 1)
            out[r, j] = code * float(scale) + float(bias)
    return torch.from_numpy(out)


@pytest.fixture(params=["fbgemm", "kernel"])
def lookup_path(request, monkeypatch):
    """Both ways the CPU serves packed rows: torch's quantized operators, and the Triton kernel
    under its interpreter (what a GPU runs)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0" if request.param == "fbgemm" else "1")
    return request.param


def trained_like(config: DLRMConfig) -> DLRM:
    torch.manual_seed(0)
    model = DLRM(config)
    with torch.no_grad():
        for table in range(config.num_categorical_features):  # rows of very different ranges
            weight = model.embeddings.table_weight(table)
            weight.mul_(torch.logspace(-2, 1, weight.shape[0])[:, None])
    return model.eval()


def float64_reference(model: DLRM, quantized: DLRM) -> DLRM:
    """``model`` in float64 with the tables ``quantized`` stores, decoded by ``unpack_float64``."""
    reference = DLRM(model.config).double().eval()
    reference.load_state_dict({k: v for k, v in model.state_dict().items()}, strict=True)
    tables = quantized.embeddings
    for i in range(tables.num_tables):
        precision, rows = tables._rows_of(i)
        values = unpack_float64(rows, tables.embedding_dim, precision) if precision in QUANTIZED else rows.double()
        reference.embeddings.load_table_(i, values)
    return reference


@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
@pytest.mark.parametrize("dim", [8, 16, 12])
def test_packing_is_torch_layout_and_within_half_a_step(precision, dim):
    torch.manual_seed(1)
    weight = torch.randn(40, dim) * torch.logspace(-3, 2, 40)[:, None]
    packed = quantize_rows(weight, precision)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (40, row_bytes(dim, precision))
    decoded = unpack_float64(packed, dim, precision)
    step = (weight.max(1).values - weight.min(1).values).double() / (2 ** BITS[precision] - 1)
    # half a step, plus the fp16 rounding of int4/int2 scales and biases (2^-11 relative)
    slack = 2.0 ** -10 * weight.abs().max(1).values.double() * (2 ** BITS[precision])
    if precision == "int8":
        slack = 1e-6 * weight.abs().max(1).values.double()
    assert bool(((decoded - weight.double()).abs() <= 0.5 * step[:, None] + slack[:, None]).all())
    # torch's own reader of the layout agrees with the definition
    op = {"int8": torch.ops.quantized.embedding_bag_byte_rowwise_offsets,
          "int4": torch.ops.quantized.embedding_bag_4bit_rowwise_offsets,
          "int2": torch.ops.quantized.embedding_bag_2bit_rowwise_offsets}[precision]
    ids = torch.arange(40)
    torch.testing.assert_close(op(packed, ids.view(-1, 1), None, False, 0, False, None, None, False).double(),
                               decoded, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
@pytest.mark.parametrize("dim", [16, 8, 128, 200])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_dequantize_gather_kernel_matches_reference(precision, dim, out_dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(2)
    packed = quantize_rows(torch.randn(300, dim), precision)
    ids = torch.randint(0, 300, (517,))
    assert supports_dequantize_gather(packed, ids, dim, precision, out_dtype)  # the kernel runs
    got = dequantize_gather(packed, ids, dim, precision, out_dtype)
    want = unpack_float64(packed, dim, precision)[ids]
    assert got.dtype == out_dtype and tuple(got.shape) == (517, dim)
    tolerance = 1e-6 if out_dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(got, dequantize_gather_reference(packed, ids, dim, precision, out_dtype))
    assert dequantize_gather(packed, ids[:0], dim, precision, out_dtype).shape == (0, dim)


def test_widths_the_kernel_cannot_view_take_the_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    packed = quantize_rows(torch.randn(10, 12), "int2")  # 3 code bytes: scales not fp16-aligned
    ids = torch.arange(10)
    assert not supports_dequantize_gather(packed, ids, 12, "int2", torch.float32)
    torch.testing.assert_close(dequantize_gather(packed, ids, 12, "int2").double(), unpack_float64(packed, 12, "int2"))


PRECISION_CASES = ["int8", "int4", "int2", "fp16", ["int4", "fp32", "int8", "int2"]]


@pytest.mark.parametrize("precisions", PRECISION_CASES, ids=str)
def test_quantized_scores_equal_float64_reference(precisions, lookup_path):
    config = DLRMConfig(5, TABLES, embedding_dim=16, bottom_mlp_sizes=[32, 16], top_mlp_sizes=[32, 1],
                        hash_indices=True, poolings=["sum", "mean", "mean", "sum"])
    model = trained_like(config)
    quantized = quantize_model(model, precisions)
    assert isinstance(quantized.embeddings, QuantizedEmbedding)
    reference = float64_reference(model, quantized)
    g = torch.Generator().manual_seed(3)
    numerical = torch.randn(257, 5, generator=g)
    categorical = torch.randint(-3000, 3000, (257, 4), generator=g)  # hashed into each table
    lengths = torch.randint(0, 4, (4 * 257,), generator=g)  # some bags empty
    bags = Bags(torch.randint(0, 10**6, (int(lengths.sum()),), generator=g),
                torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]), 4)
    with torch.no_grad():
        for ids in (categorical, bags):
            got = quantized(numerical, ids)
            want = reference(numerical.double(), ids)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5)
        # the original model is untouched, and quantization changed the scores (a real test)
        assert isinstance(model.embeddings.weight, torch.nn.Parameter)
        assert not torch.allclose(model(numerical, categorical), quantized(numerical, categorical), atol=1e-7) \
            or precisions == "fp16"


def test_checkpoint_tables_are_quantized_one_at_a_time(tmp_path, monkeypatch):
    """``build_quantized_model`` reads each table from the files and equals quantizing the loaded model."""
    config = DLRMConfig(5, TABLES, embedding_dim=8, bottom_mlp_sizes=[16, 8], top_mlp_sizes=[16, 1])
    model = trained_like(config)
    save_checkpoint(str(tmp_path / "ckpt"), model, None, None, TrainState(step=1))
    loads = []
    original = QuantizedEmbedding.load_table_
    monkeypatch.setattr(QuantizedEmbedding, "load_table_", lambda self, i, w: (loads.append(i), original(self, i, w)))
    built = build_quantized_model(str(tmp_path / "ckpt"), "int4", min_rows=50)
    assert sorted(loads) == [0, 1, 2, 3]
    assert built.embeddings.precisions == ["int4", "fp32", "int4", "int4"]
    expected = quantize_model(model, ["int4", "fp32", "int4", "int4"])
    for (name, got), (_, want) in zip(built.state_dict().items(), expected.state_dict().items()):
        assert torch.equal(got, want), name


def test_row_wise_and_nvidia_checkpoints_quantize(tmp_path):
    """A checkpoint split row-wise over two processes (committed fixture) and one in NVIDIA's layout."""
    built = build_quantized_model(FIXTURE, "int8")
    whole = torch.cat([torch.load(os.path.join(FIXTURE, f"table_0_rows_{a}_{b}.pt"), weights_only=True)
                       for a, b in ((0, 3), (3, 7))])
    assert torch.equal(built.embeddings._rows_of(0)[1], quantize_rows(whole, "int8"))
    model = build_inference_model(FIXTURE)
    nvidia_checkpoint.save(str(tmp_path / "nv"), model, epoch=0, step=0)
    from_nvidia = build_inference_model(str(tmp_path / "nv"), quantize_tables="int4")
    numerical = torch.randn(9, 3)
    categorical = torch.stack([torch.randint(0, 7, (9,)), torch.randint(0, 3, (9,))], 1)
    with torch.no_grad():
        torch.testing.assert_close(from_nvidia(numerical, categorical),
                                   quantize_model(model, "int4")(numerical, categorical))


@pytest.mark.parametrize("precisions", ["int8", ["int4", "fp16", "int2", "fp32"]], ids=str)
def test_exported_files_carry_quantized_tables(tmp_path, precisions):
    pytest.importorskip("onnxruntime")
    config = DLRMConfig(5, [3000, 7, 2000, 50], embedding_dim=16, bottom_mlp_sizes=[32, 16], top_mlp_sizes=[32, 1])
    model = trained_like(config)
    quantized = quantize_model(model, precisions)
    sizes = {}
    for name, export in (("model.pt", export_torchscript), ("model.onnx", export_onnx)):
        export(quantized, str(tmp_path / name))
        check_export(quantized, str(tmp_path / name), batch_sizes=(1, 64, 4096))  # raises when scores differ
        sizes[name] = os.path.getsize(tmp_path / name)
    export_onnx(model, str(tmp_path / "fp32.onnx"))
    fp32_bytes = table_bytes(config.table_sizes, 16, ["fp32"] * 4)
    stored = table_bytes(config.table_sizes, 16, quantized.embeddings.precisions)
    assert quantized.embeddings.table_bytes() == stored < 0.45 * fp32_bytes
    # the ONNX file is smaller than the fp32 one by (about) the tables' saving
    assert sizes["model.onnx"] < os.path.getsize(tmp_path / "fp32.onnx") - 0.9 * (fp32_bytes - stored)


def test_table_precisions_rules_and_errors():
    assert table_precisions([10, 1000, 100], "int8", min_rows=100) == ["fp32", "int8", "int8"]
    assert table_precisions([10, 20], ["int4", "fp16"]) == ["int4", "fp16"]
    with pytest.raises(ValueError, match="lists 1 precisions for the model's 2 tables"):
        table_precisions([10, 20], ["int4"])
    with pytest.raises(ValueError, match="unknown precision 'int3'"):
        table_precisions([10], "int3")
    with pytest.raises(ValueError, match="multiple of 4; choose int8"):
        table_precisions([10], "int2", embedding_dim=6)
    with pytest.raises(TypeError, match="read-only"):
        QuantizedEmbedding([5], 8, ["int8"]).table_parameter(0)


def test_serving_report_bytes():
    config = DLRMConfig(13, [10**6, 1000], embedding_dim=128)
    report = serving_report(config, device_bytes=2**30, host_bytes=2**31)
    fp32_gib = (10**6 + 1000) * 512 / 2**30
    int8_gib = (10**6 + 1000) * 136 / 2**30
    assert f"{fp32_gib:,.3f}" in report and f"{int8_gib:,.3f}" in report
    assert " 0.266 " in report and " 0.133 " in report  # int8 and int4 at D=128: (128+8)/512, (64+4)/512


SMALL = ["--synthetic_dataset_table_sizes", "3000,500,200,40", "--synthetic_dataset_num_entries", "131072",
         "--synthetic_dataset_num_test_entries", "32768", "--embedding_dim", "16", "--bottom_mlp_sizes", "32,16",
         "--top_mlp_sizes", "32,1", "--batch_size", "1024"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A model trained by the command line on learnable synthetic data."""
    from conftest import run_cli

    path = str(tmp_path_factory.mktemp("quantized") / "ckpt")
    run_cli("dlrm.scripts.main", *SMALL, "--epochs", "2", "--save_checkpoint_path", path, "--log_path", os.devnull)
    return path


def _auc(out: str) -> float:
    (line,) = [line for line in out.splitlines() if line.startswith("Test: auc")]
    return float(line.split()[2])


def test_cli_test_mode_scores_the_quantized_model(cli, checkpoint):
    """--mode test at each precision: the tables the line names are the ones scored; int8 costs
    almost no AUC, int2 visibly more."""
    aucs = {}
    for precision in ("fp32", "int8", "int2"):
        out = cli("dlrm.scripts.main", "--mode", "test", "--load_checkpoint_path", checkpoint, *SMALL,
                  "--quantize_tables", precision, "--log_path", os.devnull).stdout
        aucs[precision] = _auc(out)
        assert ("Serving precision: tables: 4 " + precision in out) == (precision != "fp32")
    assert aucs["fp32"] > 0.65  # it learned something
    assert aucs["int8"] != aucs["fp32"] and abs(aucs["int8"] - aucs["fp32"]) < 0.002
    assert abs(aucs["int2"] - aucs["fp32"]) > abs(aucs["int8"] - aucs["fp32"])


def test_cli_inference_benchmark_and_plan(cli, checkpoint, tmp_path):
    log = str(tmp_path / "bench.json")
    out = cli("dlrm.scripts.main", "--mode", "inference_benchmark", "--load_checkpoint_path", checkpoint, *SMALL,
              "--quantize_tables", "int4", "--quantize_min_rows", "300", "--inference_benchmark_batch_sizes", "1,64",
              "--inference_benchmark_steps", "5", "--log_path", log).stdout
    assert "Serving precision: tables: 2 int4, 2 fp32" in out
    import json

    rows = [r for r in map(json.loads, open(log)) if r["type"] == "inference_benchmark"]
    assert [r["batch_size"] for r in rows] == [1, 64] and all(r["throughput"] > 0 for r in rows)
    plan = cli("dlrm.scripts.main", "--mode", "plan", *SMALL, "--device_memory_gb", "1",
               "--quantize_tables", "int8,int4,fp32,fp16").stdout
    assert "Serving (weights only" in plan and "  chosen " in plan
    fp32 = (3000 + 500 + 200 + 40) * 16 * 4
    assert f"{(3000 * 24 + 500 * 12 + 200 * 64 + 40 * 32) / fp32:.3f}" in plan  # the chosen row's ratio


def test_cli_export_quantized_and_a_precision_list_that_does_not_fit(cli, checkpoint, tmp_path):
    pytest.importorskip("onnxruntime")
    out = cli("dlrm.scripts.export", "--checkpoint", checkpoint, "--output", str(tmp_path / "exp"),
              "--quantize_tables", "int4", "--check_batch_sizes", "1,64").stdout
    assert "tables: 4 int4" in out and "onnx batch 64: max abs error" in out
    proc = cli("dlrm.scripts.export", "--checkpoint", checkpoint, "--output", str(tmp_path / "bad"),
               "--quantize_tables", "int4,int8", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "--quantize_tables lists 2 precisions for the model's 4 tables" in proc.stderr
    assert not os.path.exists(tmp_path / "bad") or not os.listdir(tmp_path / "bad")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
def test_gpu_kernel_at_criteo_width(precision):
    """On a GPU: the compiled kernel at D=128 over a million rows against the float64 decoding,
    and the module's lookups through it."""
    torch.manual_seed(4)
    weight = torch.randn(1_000_000, 128)
    packed = quantize_rows(weight, precision).cuda()
    ids = torch.randint(0, 1_000_000, (65536,), device="cuda")
    assert supports_dequantize_gather(packed, ids, 128, precision, torch.float16)
    got = dequantize_gather(packed, ids, 128, precision, torch.float32).cpu().double()
    sample = torch.arange(0, 65536, 97)
    want = unpack_float64(packed[ids[sample]].cpu(), 128, precision)
    torch.testing.assert_close(got[sample], want, rtol=1e-6, atol=1e-6)
    config = DLRMConfig(13, [1000, 50_000, 7], embedding_dim=128)
    model = trained_like(config)
    quantized = quantize_model(model, precision)
    reference = float64_reference(model, quantized)
    numerical, categorical = torch.randn(4096, 13), torch.randint(0, 7, (4096, 3))
    with torch.no_grad():
        got = quantize_model(model.cuda(), precision)(numerical.cuda(), categorical.cuda()).cpu()
        torch.testing.assert_close(got.double(), reference(numerical.double(), categorical), rtol=1e-4, atol=1e-4)
