"""The sparse autoencoder recommender end to end on MovieLens-20M-size synthetic histories:
quality (P@K, R@K, NDCG@K, coverage) of the model against popularity, item-kNN, matrix
factorisation and EASE on one held-out split, and throughput in users/s of training (fp32 and
AMP in the same run) and of predict + exclusion + top-10.

    python benchmarks/recommender.py                                   # 138,493 users x 26,744 items
    python benchmarks/recommender.py --network configs/recommender/movielens_autoencoder.json
    python benchmarks/recommender.py --users 20000 --items 4000 --interactions 2000000 --epochs 3
    python benchmarks/recommender.py --network configs/recommender/mult_vae.json --batch_size 500 --epochs 5,10,20
    python benchmarks/recommender.py --device cuda --amp_dtype bf16
    python benchmarks/recommender.py --baselines "" --epochs 0                # speed only

(after ``pip install -e .``). Every figure printed is measured in this run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

import numpy as np
import torch

from dlrm.engine.logger import RunLogger
from dlrm.recommender.baselines import fit_baseline
from dlrm.recommender.checkpoint import AutoencoderState
from dlrm.recommender.csr_dataset import CsrDataset, split_holdout, write_csr
from dlrm.recommender.model import SparseAutoencoder
from dlrm.recommender.network import parse_network
from dlrm.recommender.predict import evaluate, recommend
from dlrm.recommender.scorer import model_scorer
from dlrm.recommender.train import TrainConfig, make_optimizer, train
from dlrm.recommender.user_histories import HistoryConfig, generate_user_histories

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
BASELINES = ("popularity", "itemknn", "mf", "ease")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=HistoryConfig.n_users)
    p.add_argument("--items", type=int, default=HistoryConfig.n_items)
    p.add_argument("--interactions", type=int, default=HistoryConfig.n_interactions)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heldout_fraction", type=float, default=0.2)
    p.add_argument("--network", default="configs/recommender/movielens_tuned.json")
    p.add_argument("--epochs", default="2", help="epoch counts to evaluate at, e.g. 5,10,20: one run trained on "
                   "from each count to the next (resume is exact); 0: speed figures only (the model stays untrained)")
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--amp_dtype", choices=sorted(DTYPES), default="bf16", help="precision of the training run")
    p.add_argument("--speed_steps", type=int, default=30, help="steps timed per precision for the fp32/AMP comparison")
    p.add_argument("--baselines", default="popularity,itemknn,mf,ease",
                   help=f"comma-separated, from {','.join(BASELINES)} (ease: items^2 x 12 bytes, 8.3 GiB at 27,278 "
                        f"items)")
    p.add_argument("--ease_lambda", type=float, default=250.0)
    p.add_argument("--k", default="1,5,10,20")
    p.add_argument("--device", default="cpu")
    p.add_argument("--workdir", default=None, help="where the datasets go (default: a temporary directory)")
    args = p.parse_args()
    baselines = [b for b in args.baselines.split(",") if b]
    if set(baselines) - set(BASELINES):
        p.error(f"--baselines: unknown {sorted(set(baselines) - set(BASELINES))}; choose from {','.join(BASELINES)}")
    device = torch.device(args.device)
    ks = [int(k) for k in args.k.split(",")]
    workdir = args.workdir or tempfile.mkdtemp(prefix="recommender-bench-")

    t = time.perf_counter()
    histories = generate_user_histories(HistoryConfig(n_users=args.users, n_items=args.items,
                                                      n_interactions=args.interactions), seed=args.seed)
    write_csr(os.path.join(workdir, "all"), histories.rows, overwrite=True)
    split_holdout(os.path.join(workdir, "all"), os.path.join(workdir, "input"), os.path.join(workdir, "heldout"),
                  fraction=args.heldout_fraction, seed=args.seed, overwrite=True)
    inputs, heldout = CsrDataset(os.path.join(workdir, "input")), CsrDataset(os.path.join(workdir, "heldout"))
    print(f"data: {len(inputs):,} users x {inputs.n_features:,} items, {inputs.nnz:,} input + {heldout.nnz:,} "
          f"held-out interactions ({time.perf_counter() - t:.1f} s to generate and split)")

    results = {}
    rows = inputs.rows()
    for name in baselines:
        t = time.perf_counter()
        baseline = fit_baseline(name, rows, **({"regularization": args.ease_lambda} if name == "ease" else {}))
        fit_s = time.perf_counter() - t
        t = time.perf_counter()
        results[name] = evaluate(recommend(lambda csr, b=baseline: b.scores(csr[0], csr[1]), inputs, max(ks), 1024),
                                 heldout, ks)
        print(f"{name}: fit {fit_s:.1f} s, recommend {len(inputs) / (time.perf_counter() - t):,.0f} users/s")

    network = parse_network(args.network).resolve(inputs.n_features, inputs.n_features)
    print(f"network {args.network}: hidden {[layer.n for layer in network.hidden]}, {network.error_function}, "
          f"optimizer {network.optimizer.kind} alpha {network.optimizer.alpha}")
    for precision in ("fp32", args.amp_dtype) if args.amp_dtype != "fp32" else ("fp32",):
        model = SparseAutoencoder(network, seed=args.seed, device=device)
        cfg = TrainConfig(batch_size=args.batch_size, epochs=1, seed=args.seed, shuffle=True,
                          amp_dtype=DTYPES[precision], max_steps=args.speed_steps, log_every_steps=0)
        train(model, make_optimizer(model, network.optimizer), inputs, inputs, dataclasses.replace(cfg, max_steps=3),
              RunLogger(enabled=False), device)  # warm-up
        summary = train(model, make_optimizer(model, network.optimizer), inputs, inputs, cfg,
                        RunLogger(enabled=False), device)
        print(f"train speed {precision}: {summary['users_per_s']:,.0f} users/s (batch {args.batch_size}, "
              f"{args.speed_steps} steps)")

    model = SparseAutoencoder(network, seed=args.seed, device=device)
    optimizer, state = make_optimizer(model, network.optimizer), AutoencoderState()
    for epochs in sorted({int(e) for e in args.epochs.split(",")} - {0}):
        cfg = TrainConfig(batch_size=args.batch_size, epochs=epochs, seed=args.seed, shuffle=True,
                          amp_dtype=DTYPES[args.amp_dtype], log_every_steps=100)
        first = state.epoch
        summary = train(model, optimizer, inputs, inputs, cfg, RunLogger(), device, state)
        print(f"train epochs {first}-{epochs} ({args.amp_dtype}): {summary['seconds']:.0f} s, "
              f"{summary['users_per_s']:,.0f} users/s")
        results[f"autoencoder@{epochs}"] = evaluate(recommend(model_scorer(model, DTYPES[args.amp_dtype]), inputs,
                                                              max(ks), args.batch_size * 4), heldout, ks)
    t = time.perf_counter()
    for _ in recommend(model_scorer(model, DTYPES[args.amp_dtype]), inputs, 10, args.batch_size * 4):
        pass
    print(f"predict + exclusion + top-10: {len(inputs) / (time.perf_counter() - t):,.0f} users/s")

    print(f"\n{'':16}" + "".join(f"{f'P@{k}':>8}{f'R@{k}':>8}{f'NDCG@{k}':>9}" for k in ks) + f"{'cov@' + str(max(ks)):>9}")
    for name, metrics in results.items():
        line = "".join(f"{m.precision:8.4f}{m.recall:8.4f}{m.ndcg:9.4f}" for m in metrics)
        print(f"{name:16}{line}{metrics[-1].coverage:9.4f}")


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
