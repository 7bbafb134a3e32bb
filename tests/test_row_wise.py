"""Tables split row-wise across processes: blocks of rows whose partial lookups add up in the
all-to-all. Checked against a whole table (the same lookups and initial weights from any split),
against one process training on the same data (float64, step by step, every layout and
optimizer, one-hot and multi-hot), and across checkpoints written and read under different
placements and process counts."""

import json
import os

import pytest
import torch
import torch.distributed as dist

from dlrm.data.batch import Bags
from dlrm.data.rank_source import RankSource
from dlrm.data.synthetic import SyntheticDataset
from dlrm.distributed.exchange import EmbeddingExchange
from dlrm.distributed.planner import plan_tables
from dlrm.engine.collectives import Collectives, ProcessGroupCollectives
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.nn.table_spec import TableShard
from dlrm.nn.init import INIT_BLOCK_ROWS
from dlrm.training.checkpoint import TrainState, load_checkpoint, save_checkpoint
from dlrm.training.optimizers import OptimizerConfig, make_optimizer
from dlrm.training.train import evaluate, make_train_step
from test_distributed import free_port
from conftest import spawn

CPU = torch.device("cpu")
LAYOUTS = ["joint", "multi_table", "joint_fused"]

# ----------------------------------------------------------------------------- one process

BIG = 2 * INIT_BLOCK_ROWS + 5  # blocks of the initialisation cross inside it
SIZES = [3, 1000, 17, BIG]
POOLS = ["sum", "mean", "mean", "sum"]


def _split_models(embedding_type, hash_indices, cuts_1, cuts_3, dtype="fp32"):
    """The whole model, and one model per block: table 0 whole in the first, tables 1 and 3 cut
    at ``cuts_1`` / ``cuts_3`` (one block in each model), built as processes build them."""
    cfg = DLRMConfig(5, SIZES, 8, [16, 8], [32, 16, 1], embedding_type=embedding_type, hash_indices=hash_indices,
                     poolings=POOLS, embedding_dtype=dtype)
    torch.manual_seed(0)
    whole = DLRM(cfg)
    parts = []
    for k in range(len(cuts_1) - 1):
        torch.manual_seed(0)
        blocks = [TableShard(1, cuts_1[k], cuts_1[k + 1]), TableShard(3, cuts_3[k], cuts_3[k + 1])]
        parts.append(DLRM(cfg, tables=([0] if k == 0 else []) + blocks))
    return whole, parts


def _random_bags(sizes, batch, scale, generator):
    lengths = torch.randint(0, 4, (len(sizes) * batch,), generator=generator)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    table = torch.repeat_interleave(torch.arange(len(sizes)), lengths.view(len(sizes), batch).sum(1))
    values = (torch.rand(int(offsets[-1]), generator=generator, dtype=torch.float64)
              * torch.tensor(sizes)[table] * scale).long()
    return Bags(values, offsets, len(sizes))


@pytest.mark.parametrize("embedding_type", LAYOUTS)
@pytest.mark.parametrize("hash_indices", [False, True])
def test_blocks_hold_the_rows_of_the_whole_table_and_their_lookups_add_up_to_its(embedding_type, hash_indices):
    cuts_1 = [0, 1, 400, 1000]  # a block of a single row, too
    cuts_3 = [0, INIT_BLOCK_ROWS - 3, INIT_BLOCK_ROWS + 7, BIG]
    whole, parts = _split_models(embedding_type, hash_indices, cuts_1, cuts_3)
    for k, part in enumerate(parts):
        first = 1 if k == 0 else 0  # position of table 1's block in this part
        for position, (table, cuts) in enumerate([(1, cuts_1), (3, cuts_3)]):
            torch.testing.assert_close(part.embeddings.table_weight(first + position),
                                       whole.embeddings.table_weight(table)[cuts[k]:cuts[k + 1]], rtol=0, atol=0)
    generator = torch.Generator().manual_seed(3)
    scale = 3 if hash_indices else 1  # with hashing, ids beyond the table are fine
    ids = torch.stack([torch.randint(0, rows * scale, (64,), generator=generator) for rows in SIZES], 1)
    bags = _random_bags(SIZES, 64, scale, generator)
    for batch in (ids, bags):
        expected = whole.embed(batch).double()
        picked = [batch[:, [0, 1, 3]], batch[:, [1, 3]]] if not isinstance(batch, Bags) else \
            [batch.select([0, 1, 3]), batch.select([1, 3])]
        outs = [part.embed(picked[k if k == 0 else 1]).double() for k, part in enumerate(parts)]
        torch.testing.assert_close(outs[0][:, 0], expected[:, 0], rtol=0, atol=0)
        for position, table in ((1, 1), (2, 3)):
            summed = outs[0][:, position] + sum(out[:, position - 1] for out in outs[1:])
            torch.testing.assert_close(summed, expected[:, table], rtol=1e-6, atol=1e-7)


def test_a_block_outside_its_table_is_refused():
    cfg = DLRMConfig(5, [10, 20], 8, [16, 8], [32, 16, 1])
    with pytest.raises(ValueError, match=r"rows \[5, 25\) of table 1"):
        DLRM(cfg, tables=[TableShard(1, 5, 25)])
    with pytest.raises(ValueError, match=r"rows \[3, 3\) of table 0"):
        DLRM(cfg, tables=[TableShard(0, 3, 3)])


def test_half_precision_blocks_hold_the_rounded_rows_of_the_whole_table():
    whole, parts = _split_models("joint", False, [0, 500, 1000], [0, INIT_BLOCK_ROWS + 1, BIG], dtype="bf16")
    assert parts[1].embeddings.table_weight(0).dtype == torch.bfloat16
    torch.testing.assert_close(parts[1].embeddings.table_weight(1),
                               whole.embeddings.table_weight(3)[INIT_BLOCK_ROWS + 1:], rtol=0, atol=0)


# ----------------------------------------------------------------------------- processes

TABLES = [3, 1000, 17, 250, 5, 40]
POOLINGS = ["sum", "mean", "sum", "mean", "sum", "sum"]
BAG_SIZES = [1, 3, 2, 2, 1, 4]
BATCH, LR = 61, 0.3  # 61: uneven local batches


def _config(embedding_type):
    return DLRMConfig(5, TABLES, 8, [16, 8], [32, 16, 1], embedding_type=embedding_type, poolings=POOLINGS)


def _data(split, rows, multi_hot):
    bags = dict(bag_sizes=BAG_SIZES, pooling=POOLINGS) if multi_hot else {}
    return SyntheticDataset(5, TABLES, rows, BATCH if split == "train" else 50, seed=11, split=split, **bags)


def _entries(world, row_wise, override=None):
    plan = plan_tables(TABLES, 8, world, 2**40, override=override, row_wise=row_wise)
    return [plan.entries(rank) for rank in range(world)]


def _run(model, optimizer, collectives, data, first, last, ckpt_in, ckpt_out):
    """Steps ``first .. last - 1`` (loading ``ckpt_in`` first, saving ``ckpt_out`` after);
    returns the global losses."""
    precision = Precision("cpu")
    scaler = precision.grad_scaler()
    if ckpt_in:
        state = load_checkpoint(ckpt_in, model, optimizer, scaler)
        assert state.step == first
    step = make_train_step(model, optimizer, scaler, precision, collectives)
    losses = [float(collectives.sum(step(data.read_batch(i)))) for i in range(first, last)]
    if ckpt_out:
        save_checkpoint(ckpt_out, model, optimizer, scaler, TrainState(step=last), collectives=collectives)
    return losses


def _worker(rank, world, port, entries, out_dir, job):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DLRM(_config(job["embedding_type"]), tables=entries[rank]).double()
    model.exchange = EmbeddingExchange(entries, rank)
    collectives = ProcessGroupCollectives(CPU)
    optimizer = make_optimizer(model, LR, OptimizerConfig(embedding=job["optimizer"]))
    tables = [t.table if isinstance(t, TableShard) else t for t in entries[rank]]

    def source(split, rows):
        return RankSource(lambda *a: _data(split, rows, job["multi_hot"]), tables, rank, world)

    losses = _run(model, optimizer, collectives, source("train", job["last"] * BATCH), job["first"], job["last"],
                  job.get("load"), job.get("save"))
    auc = evaluate(model, source("test", 150), CPU, Precision("cpu"), collectives=collectives).auc
    blocks = {}
    for i, entry in enumerate(entries[rank]):
        start = entry.start if isinstance(entry, TableShard) else 0
        blocks[f"{tables[i]}:{start}"] = model.embeddings.table_weight(i).clone()
    torch.save({"blocks": blocks, "losses": losses, "auc": auc,
                "dense": {k: v for k, v in model.state_dict().items() if not k.startswith("embeddings.")}},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # as tests/test_distributed.py: skip finalization, where gloo's threads can abort


def _reference(job, first=0, last=None, load=None, save=None):
    """One process with every table whole, float64: the same steps on the same data."""
    torch.manual_seed(0)
    model = DLRM(_config(job["embedding_type"])).double()
    optimizer = make_optimizer(model, LR, OptimizerConfig(embedding=job["optimizer"]))
    last = job["last"] if last is None else last
    losses = _run(model, optimizer, Collectives(), _data("train", job["last"] * BATCH, job["multi_hot"]), first, last,
                  load, save)
    auc = evaluate(model, _data("test", 150, job["multi_hot"]), CPU, Precision("cpu")).auc
    return model, losses, auc


def _spawn(tmp_path, entries, job):
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    out.mkdir()
    spawn(_worker, args=(len(entries), free_port(), entries, str(out), job), nprocs=len(entries))
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(len(entries))]


def _assert_equal_to(results, reference, ref_losses, ref_auc):
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-10, atol=0)
        assert result["auc"] == pytest.approx(ref_auc, abs=1e-12)
        for name, value in result["dense"].items():
            torch.testing.assert_close(value, reference.state_dict()[name], rtol=1e-10, atol=1e-13, msg=name)
    covered = {t: 0 for t in range(len(TABLES))}
    for result in results:
        for key, weight in result["blocks"].items():
            table, start = map(int, key.split(":"))
            expected = reference.embeddings.table_weight(table)[start:start + weight.shape[0]]
            torch.testing.assert_close(weight, expected, rtol=1e-10, atol=1e-13, msg=key)
            covered[table] += weight.shape[0]
    assert covered == dict(enumerate(TABLES))  # every row of every table, once


@pytest.mark.parametrize(
    "embedding_type,optimizer,multi_hot,world,row_wise",
    [
        ("joint", "sgd", False, 3, [1, 3]),
        ("multi_table", "sgd", True, 3, [1, 3]),
        ("joint_fused", "sgd", True, 2, "all"),
        ("joint_fused", "rowwise_adagrad", False, 3, [1, 5]),
        ("joint", "adagrad", True, 2, [0, 1, 2]),  # table 0 (3 rows): blocks of 1 and 2 rows
    ],
    ids=["joint-onehot-3", "multi_table-bags-3", "fused-bags-2-all", "fused-rowwise_adagrad-3", "joint-adagrad-bags-2"],
)
def test_row_wise_processes_equal_one_process_step_by_step(tmp_path, embedding_type, optimizer, multi_hot, world,
                                                            row_wise):
    """float64: the only differences are the order of additions (partial sums), rtol 1e-10."""
    job = dict(embedding_type=embedding_type, optimizer=optimizer, multi_hot=multi_hot, first=0, last=4)
    entries = _entries(world, row_wise)
    assert any(isinstance(e, TableShard) for rank in entries for e in rank)
    results = _spawn(tmp_path, entries, job)
    _assert_equal_to(results, *_reference(job))


def test_checkpoints_cross_between_row_wise_and_table_wise_plans_and_process_counts(tmp_path):
    """Row-wise Adagrad (state per row, saved with the rows): 2 processes with every table split
    save at step 2; 3 processes with whole tables resume to step 4 and save; 2 processes with
    other tables split resume that to step 6; each equals one process's uninterrupted 6 steps.
    One process also resumes the row-wise checkpoint."""
    job = dict(embedding_type="joint_fused", optimizer="rowwise_adagrad", multi_hot=False)
    first_ckpt, second_ckpt = str(tmp_path / "rw2"), str(tmp_path / "tw3")
    row_wise = _entries(2, "all")
    _spawn(tmp_path, row_wise, dict(job, first=0, last=2, save=first_ckpt))
    assert sorted(n for n in os.listdir(first_ckpt) if n.startswith("table_1")) == [
        "table_1_rows_0_500.pt", "table_1_rows_0_500_optimizer.pt",
        "table_1_rows_500_1000.pt", "table_1_rows_500_1000_optimizer.pt"]
    table_wise = _entries(3, "never")
    _spawn(tmp_path, table_wise, dict(job, first=2, last=4, load=first_ckpt, save=second_ckpt))
    assert "table_1.pt" in os.listdir(second_ckpt)
    other_split = _entries(2, [2, 3, 4], override=[[0, 5], [1]])
    results = _spawn(tmp_path, other_split, dict(job, first=4, last=6, load=second_ckpt))
    reference, losses, auc = _reference(dict(job, last=6))
    _assert_equal_to(results, reference, losses[4:], auc)
    resumed, resumed_losses, resumed_auc = _reference(dict(job, last=6), first=2, load=first_ckpt)
    torch.testing.assert_close(torch.tensor(resumed_losses), torch.tensor(losses[2:]), rtol=1e-10, atol=0)
    for t in range(len(TABLES)):
        torch.testing.assert_close(resumed.embeddings.table_weight(t), reference.embeddings.table_weight(t),
                                   rtol=1e-10, atol=1e-13)


def test_a_checkpoint_missing_a_block_is_refused_before_anything_is_loaded(tmp_path):
    job = dict(embedding_type="joint", optimizer="sgd", multi_hot=False)
    path = str(tmp_path / "ckpt")
    _spawn(tmp_path, _entries(2, [1]), dict(job, first=0, last=1, save=path))
    os.remove(os.path.join(path, "table_1_rows_500_1000.pt"))
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    del meta["files"]["table_1_rows_500_1000.pt"]
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)
    torch.manual_seed(0)
    model = DLRM(_config("joint")).double()
    before = model.embeddings.table_weight(1).clone()
    with pytest.raises(Exception, match=r"embedding table 1 .*table_1_rows_0_500.pt.* do not cover its 1000 rows"):
        load_checkpoint(path, model)
    assert torch.equal(model.embeddings.table_weight(1), before)
