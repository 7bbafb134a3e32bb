"""The training path on a CUDA device, against CPU references (run with ``pytest -m gpu``)."""

import copy
import io

import pytest
import torch
from sklearn.metrics import roc_auc_score

from dlrm.data.batch import Batch
from dlrm.data.synthetic import SyntheticDataset
from dlrm.engine.logger import RunLogger
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.training.lr_schedule import LRSchedule
from dlrm.training.optimizers import make_optimizer
from dlrm.training.train import TrainConfig, bce_loss, evaluate, train, train_step

pytestmark = pytest.mark.gpu
TABLES = [50, 400, 3, 1000, 20, 7, 200, 60]


def small_model(device, seed=0):
    torch.manual_seed(seed)
    return DLRM(DLRMConfig(13, TABLES, 16, [32, 16], [64, 32, 1]), device=device)


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def test_cuda_step_matches_float64_cpu_step():
    cuda = torch.device("cuda")
    model = small_model(cuda)
    reference = copy.deepcopy(model).cpu().double()
    g = torch.Generator().manual_seed(1)
    batch = Batch(torch.rand(256, 13, generator=g), torch.stack([torch.randint(0, n, (256,), generator=g) for n in TABLES], 1),
                  torch.rand(256, generator=g) < 0.3)
    lr = 0.5
    loss = train_step(model, batch.to(cuda), make_optimizer(model, lr), Precision("cuda").grad_scaler(), Precision("cuda"))
    ref_loss = bce_loss(reference(batch.numerical.double(), batch.categorical), batch.label)
    ref_loss.backward()
    torch.testing.assert_close(loss.cpu().double(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        grad = q.grad.to_dense() if q.grad.is_sparse else q.grad
        torch.testing.assert_close(p.detach().cpu().double(), (q - lr * grad).detach(), rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("amp_dtype", [None, torch.float16, torch.bfloat16])
def test_cuda_training_learns_and_auc_matches_sklearn(amp_dtype):
    cuda = torch.device("cuda")
    train_src = SyntheticDataset(13, TABLES, 256 * 1024, 1024, device=cuda, seed=3, split="train")
    test_src = SyntheticDataset(13, TABLES, 32 * 1024, 8192, device=cuda, seed=3, split="test")
    model = small_model(cuda)
    precision = Precision("cuda", amp_dtype)
    cfg = TrainConfig(schedule=LRSchedule(lr=0.5, warmup_steps=20), log_every_steps=100)
    summary = train(model, make_optimizer(model, 0.5), precision.grad_scaler(), precision, train_src, test_src, cfg,
                    cuda, RunLogger(None, stream=io.StringIO()))
    assert summary["best_auc"] > 0.70
    result = evaluate(model, test_src, cuda, Precision("cuda"))
    batches = [test_src.read_batch(i) for i in range(len(test_src))]
    with torch.no_grad():
        scores = torch.cat([model(b.numerical, b.categorical) for b in batches]).cpu().numpy()
    labels = torch.cat([b.label for b in batches]).cpu().numpy()
    assert result.auc == pytest.approx(roc_auc_score(labels, scores), abs=1e-6)


def test_cuda_fp16_overflow_skips_every_update():
    cuda = torch.device("cuda")
    model = small_model(cuda)
    before = copy.deepcopy(model.state_dict())
    batch = SyntheticDataset(13, TABLES, 1024, 1024, device=cuda).read_batch(0)
    precision = Precision("cuda", torch.float16)
    scaler = precision.grad_scaler(init_scale=2.0**60)
    train_step(model, batch, make_optimizer(model, 1.0), scaler, precision)
    assert scaler.get_scale() < 2.0**60
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_cli_trains_on_cuda_with_amp(cli, tmp_path):
    log = str(tmp_path / "log.json")
    out = cli("dlrm.scripts.main", "--base_device", "cuda", "--amp", "--batch_size", "4096", "--max_steps", "30",
              "--print_freq", "10", "--lr", "1", "--warmup_steps", "5", "--decay_start_step", "0", "--decay_steps", "0",
              "--synthetic_dataset_num_test_entries", "65536", "--log_path", log).stdout
    assert "precision float16" in out and "Finished (completed) after 30 steps" in out
