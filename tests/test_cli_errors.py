"""Every command-line tool, run as a user runs it, on bad input: one line, exit 2, no traceback.

For each CLI: ``--help`` exits 0 and lists the flags of that script (not only those of
``__main__``, which for ``triton/deployer.py`` are none); and each row of CASES (a bad flag
value, an unknown or missing flag, a path that is missing or of the wrong kind, a file that is
not what it should be) must give exit status 2, exactly one non-empty line on stderr holding the
expected fragment (the flag or file it is about), no "Traceback" anywhere, and nothing left at
the output location ``{out}``.

Each run is a real subprocess (``sys.executable``). Most of their time is importing torch on one
core, so the selected runs start together up front, two at a time, and each test waits for its
own. To add a CLI, add it to CLIS and HELP; to add a case, add one line to CASES, e.g.

    Case("main", "--batch_size=0 --log_path={out}.log.json", "--batch_size must be positive"),

(point every file a tool writes by default away from the repository; main's --log_path goes
beside {out}, since a run that fails still records why in its log's ``summary``).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import yaml
import warm_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARALLEL = 2
TIMEOUT_S = 120

CLIS = {
    "export": ["-m", "dlrm.scripts.export"],
    "convert_checkpoint": ["-m", "dlrm.scripts.convert_checkpoint"],
    "deploy": ["-m", "dlrm.scripts.deploy"],
    "deployer": ["triton/deployer.py"],
    "transcode": ["-m", "dlrm.scripts.transcode"],
    "synthetic": ["-m", "dlrm.scripts.prepare_synthetic_dataset"],
    "gen_csv": ["-m", "dlrm.scripts.gen_csv"],
    "client": ["triton/client.py"],
    "local_server": ["triton/local_server.py"],
    "preproc": ["-m", "preproc"],
    "main": ["-m", "dlrm.scripts.main"],
    "spark_train": ["-m", "dlrm.scripts.spark_train"],
    "spark_score": ["-m", "dlrm.scripts.spark_score"],
    "spark_recommend": ["-m", "dlrm.scripts.spark_recommend"],
    "recommender_generate": ["-m", "dlrm.scripts.recommender_generate"],
    "recommender_train": ["-m", "dlrm.scripts.recommender_train"],
    "recommender_predict": ["-m", "dlrm.scripts.recommender_predict"],
    "recommender_evaluate": ["-m", "dlrm.scripts.recommender_evaluate"],
    "wide_train": ["-m", "dlrm.scripts.wide_train"],
    "plot": ["-m", "dlrm.scripts.plot"],
}


@dataclass(frozen=True)
class Case:
    cli: str
    args: str  # split on whitespace; each piece then .format()-ed with the paths of `paths` and {out}
    expect: str  # must appear on stdout (help, exit 0) or in the one line of stderr (exit 2)
    status: int = 2

    @property
    def id(self) -> str:
        return f"{self.cli}:{self.args}"


# --help of each CLI: exit 0, and one of its own flags is listed.
HELP = [
    Case("export", "--help", "--check_batch_sizes", 0),
    Case("convert_checkpoint", "--help", "--to", 0),
    Case("deploy", "--helpshort", "--model_repository", 0),
    Case("deployer", "--help", "--model_repository", 0),  # the flags live in dlrm.scripts.deploy
    Case("transcode", "-?", "--num_categorical", 0),
    Case("synthetic", "--help", "--synthetic_dataset_table_sizes", 0),
    Case("gen_csv", "--help", "--feature_spec_in", 0),
    Case("client", "--help", "--soak_streams", 0),
    Case("local_server", "-h", "--server_env", 0),
    Case("preproc", "--help", "--frequency_threshold", 0),
    Case("main", "--help", "--inference_benchmark_batch_sizes", 0),
    Case("spark_train", "--help", "--spark_conf", 0),
    Case("spark_score", "--help", "--raw", 0),
    Case("spark_recommend", "--help", "--output_format", 0),
    Case("recommender_generate", "--help", "--heldout_fraction", 0),
    Case("recommender_train", "--help", "--checkpoint_every_steps", 0),
    Case("recommender_predict", "--help", "--scores_path", 0),
    Case("recommender_evaluate", "--help", "--knn_neighbours", 0),
    Case("wide_train", "--help", "--field_sizes", 0),
    Case("plot", "--help", "--tags", 0),
]

# Fixture paths: missing (absent), file (random bytes), dir (empty directory), ckpt_damaged
# (meta.json that is not JSON), dataset (a valid 2-split dataset), truncated (its test
# numerical.bin cut short), badspec (feature_spec.yaml that is not UTF-8), tsv_bad (line 2 has a
# non-integer id), tsv_latin1 (not UTF-8), empty (0 bytes), criteo / criteo_bad (Criteo lines,
# the second with a malformed line 2).
CASES = [
    Case("export", "--output={out}", "--checkpoint is required"),
    Case("convert_checkpoint", "--checkpoint={missing} --output={out}", "--to is required"),
    Case("convert_checkpoint", "--checkpoint={missing} --output={out} --to=onnx", "--to=onnx"),
    Case("convert_checkpoint", "--checkpoint={missing} --output={out} --to=nvidia", "No checkpoint at {missing}"),
    Case("convert_checkpoint", "--checkpoint={dir} --output={out} --to=dlrm", "has no meta.json"),
    Case("export", "--checkpoint={missing} --output={out}", "No checkpoint at {missing}"),
    Case("export", "--checkpoint={dir} --output={out}", "has no meta.json"),
    Case("export", "--checkpoint={file} --output={out}", "No checkpoint at {file}"),
    Case("export", "--checkpoint={missing} --output={out} --check_batch_sizes=1,x", "--check_batch_sizes"),
    Case("export", "--checkpoint={missing} --output={out} --check_batch_sizes=64,-3", "--check_batch_sizes must be positive"),
    Case("export", "--checkpoint={missing} --output={out} --format=onnx,pdf", "unknown format(s) ['pdf']"),
    Case("export", "--checkpoint={missing} --output={out} --opset=99", "--opset 99"),
    Case("export", "--checkpoint={missing} --output={file}", "--output {file} is a file"),
    Case("deploy", "--checkpoint={ckpt_damaged} --model_repository={out}", "meta.json: not readable as JSON"),
    Case("deploy", "--checkpoint={missing} --model_repository={out} --max_batch_size=0", "max_batch_size"),
    Case("deploy", "--checkpoint={missing} --model_repository={out} --format=torchscript --quantize_tables=int8",
         "deploy it with --instance_kind cpu, or with --format onnx"),
    Case("export", "--checkpoint={missing} --output={out} --quantize_tables=int8,int9", "unknown precision 'int9'"),
    Case("main", "--quantize_tables=int4 --log_path={out}.log.json", "--quantize_tables stores a trained model's"),
    Case("main", "--mode=test --quantize_tables=int3 --log_path={out}.log.json", "unknown precision 'int3'"),
    Case("deploy", "--checkpoint={missing} --model_repository={out} --preferred_batch_sizes=4096,abc", "--preferred_batch_sizes"),
    Case("deploy", "--checkpoint={missing} --model_repository={file}", "--model_repository {file} is a file"),
    Case("deployer", "--checkpoint={dir} --model_repository={out} --instance_kind=tpu", "--instance_kind"),
    Case("deployer", "--checkpoint={dir} --model_repository={out} --chekpoint={dir}", "Unknown command line flag 'chekpoint'"),
    Case("transcode", "--train={missing} --output={out}", "{missing}: input file not found"),
    Case("transcode", "--train={dir} --output={out}", "{dir}: is a directory"),
    Case("transcode", "--train={tsv_latin1} --output={out}", "{tsv_latin1}: not UTF-8 text"),
    Case("transcode", "--train={tsv_bad} --output={out}/new/dataset --num_numerical=1 --num_categorical=1 --cardinalities=5",
         "{tsv_bad}, line 2"),
    Case("transcode", "--train={empty} --output={out}", "{empty}: no data lines"),
    Case("transcode", "--train={tsv_bad} --output={out} --num_numerical=-1", "--num_numerical"),
    Case("transcode", "--train={tsv_bad} --output={out} --delimiter=semicolon", "--delimiter"),
    Case("transcode", "--output={out}", "give --input DIR"),
    Case("transcode", "--input={csv} --output={out} --num_numerical=3", "leave out --num_numerical"),
    Case("transcode", "--input={csv_short} --output={out}", "ends after 2 rows but"),
    Case("transcode", "--input={dataset} --output={out}", "chunk type 'split_binary'"),
    Case("gen_csv", "--feature_spec_in={missing} --output={out}", "{missing}: feature spec not found"),
    Case("gen_csv", "--feature_spec_in={csv} --output={out} --size=0", "--size"),
    Case("gen_csv", "--feature_spec_in={csv_auto} --output={out}", "has cardinality 'auto'"),
    Case("synthetic", "", "--synthetic_dataset_dir is required"),
    Case("synthetic", "--synthetic_dataset_dir={out} --feature_spec={dataset} --preset=criteo_fl15",
         "leave out --preset"),
    Case("synthetic", "--synthetic_dataset_dir={out} --feature_spec={spec_escape}", "is not inside the dataset directory"),
    Case("synthetic", "--synthetic_dataset_dir={out} --synthetic_dataset_table_sizes=10,x", "--synthetic_dataset_table_sizes"),
    Case("synthetic", "--synthetic_dataset_dir={out} --synthetic_dataset_table_sizes=10,0", "must be at least 1"),
    Case("synthetic", "--synthetic_dataset_dir={out} --preset=fl16", "--preset"),
    Case("synthetic", "--synthetic_dataset_dir={out} --synthetic_zipf_exponent=0", "--synthetic_zipf_exponent must be > 0"),
    Case("synthetic", "--synthetic_dataset_dir={file}", "--synthetic_dataset_dir {file} is a file, not a folder"),
    Case("synthetic", "--synthetic_dataset_dir={dataset}", "{dataset} already holds a dataset; pass --overwrite"),
    Case("client", "--dataset={missing} --log_path={out}", "not found"),
    Case("client", "--dataset={badspec} --log_path={out}", "feature_spec.yaml: not UTF-8 text"),
    Case("client", "--dataset={dir} --feature_spec={file} --log_path={out}", "{file}: not UTF-8 text"),
    Case("client", "--dataset={truncated} --log_path={out}", "is not a multiple of the row size"),
    Case("client", "--dataset={dataset} --split=nope --log_path={out}", "no split 'nope'"),
    Case("client", "--dataset={dataset} --batch_size=0 --log_path={out}", "--batch_size"),
    Case("local_server", "--model_repository={missing} --workdir={out}", "--model_repository {missing} does not exist"),
    Case("local_server", "--model_repository={file} --workdir={out}", "--model_repository {file} is not a directory"),
    Case("local_server", "--model_repository={dir} --workdir={out} --http_port=x", "--http_port"),
    Case("local_server", "--model_repository={dir} --workdir={out} --grpc_port=70000", "--grpc_port"),
    Case("local_server", "--workdir={out}", "--model_repository is required"),
    Case("preproc", "--input_dir={missing} --output={out}", "{missing}: not a directory"),
    Case("preproc", "--input_dir={dir} --output={out}", "found neither Criteo Terabyte day files"),
    Case("preproc", "--train={criteo_bad} --test={criteo} --output={out}/new --workers=1 --progress=off",
         "{criteo_bad}, line 2"),
    Case("preproc", "--train={empty} --test={criteo} --output={out}", "split 'train' has no rows"),
    Case("preproc", "--train={criteo} --test={criteo_bad} --output={out} --frequency_threshold=14:x", "frequency threshold '14:x'"),
    Case("preproc", "--train={criteo} --test={criteo_bad} --output={out} --workers=x", "--workers"),
    Case("preproc", "--train={criteo} --test={criteo_bad} --output={file}", "--output {file} is a file"),
    Case("preproc", "--train={criteo} --output={out}", "both --train and --test"),
    Case("main", "--batch_size=0 --log_path={out}.log.json", "--batch_size must be positive"),
    Case("main", "--batch_size=x --log_path={out}.log.json", "--batch_size"),
    Case("main", "--lr=nan --log_path={out}.log.json", "--lr must be a finite number"),
    Case("main", "--warmup_steps=-1 --log_path={out}.log.json", "--warmup_steps"),
    Case("main", "--top_mlp_sizes=64,x --log_path={out}.log.json", "--top_mlp_sizes"),
    Case("main", "--top_mlp_sizes=64,2 --log_path={out}.log.json", "top_mlp_sizes[-1] must be 1"),
    Case("main", "--base_device=tpu --log_path={out}.log.json", "--base_device tpu"),
    Case("main", "--base_device=cuda:x --log_path={out}.log.json", "--base_device cuda:x"),
    Case("main", "--log_path={dir}", "--log_path {dir} is a folder"),
    Case("main", "--log_path={file}/log.json", "--log_path {file}/log.json: {file} is a file, not a folder"),
    Case("main", "--tensorboard_dir={file}/board --log_path={out}.log.json",
         "--tensorboard_dir {file}/board: {file} is a file, not a folder"),
    Case("main", "--mode=test --log_path={out}.log.json", "--load_checkpoint_path"),
    Case("main", "--mode=test --load_checkpoint_path={ckpt_damaged} --log_path={out}.log.json",
         "meta.json: not readable as JSON"),
    Case("main", "--dataset={missing} --log_path={out}.log.json", "feature spec {missing}/feature_spec.yaml not found"),
    Case("main", "--dataset={badspec} --log_path={out}.log.json", "feature_spec.yaml: not UTF-8 text"),
    Case("main", "--dataset={truncated} --log_path={out}.log.json", "is not a multiple of the row size"),
    Case("main", "--dataset={dataset} --save_checkpoint_path={file} --log_path={out}.log.json",
         "--save_checkpoint_path {file} is a file, not a folder"),
    Case("main", "--dataset={dataset} --mode=inference_benchmark --inference_benchmark_batch_sizes=0 "
         "--log_path={out}.log.json", "--inference_benchmark_batch_sizes: 0"),
    # spark_train checks main's flags, spark_score its model, before Spark starts
    Case("spark_train", "--num_processes=1 -- --bogus_flag 1 --save_checkpoint_path={out} --log_path={out}.log.json",
         "Unknown command line flag 'bogus_flag'"),
    Case("spark_train", "--num_processes=1 -- --batch_size 0 --save_checkpoint_path={out} --log_path={out}.log.json",
         "--batch_size must be positive, got 0"),
    Case("spark_score", "--model={missing} --dataset={dataset} --split=test --output={out}",
         "--model {missing}: no such file"),
    Case("spark_score", "--model={file} --dataset={dataset} --split=test --output={out}",
         "--model {file}: not an ONNX model"),
    Case("spark_recommend", "--checkpoint={missing} --input={missing} --output={out}",
         "--input {missing} does not exist"),
    Case("spark_recommend", "--checkpoint={missing} --input={dir} --text={file} --output={out}",
         "give exactly one source of histories"),
    Case("spark_recommend", "--checkpoint={missing} --input={dir} --output={out} --output_format=csv",
         "--output_format"),
    Case("recommender_generate", "--synthetic", "--output is required"),
    Case("recommender_generate", "--output={out}", "give exactly one source"),
    Case("recommender_generate", "--text={missing} --output={out}", "--text {missing}: no such file"),
    Case("recommender_generate", "--synthetic --output={file}", "--output {file} is a file"),
    Case("recommender_generate", "--synthetic --heldout_fraction=0.2 --heldout_last=3 --output={out}", "not both"),
    Case("recommender_train", "--network=configs/recommender/movielens_autoencoder.json --checkpoint_path={out}",
         "--input is required"),
    Case("recommender_train", "--network={missing} --input={dir} --checkpoint_path={out}",
         "{missing}: no such network definition file"),
    Case("recommender_train", "--network=notebooks/dlrm_walkthrough.ipynb --input={dir} --checkpoint_path={out}",
         "'cells': unknown key"),  # a JSON file that is not a network definition
    Case("recommender_train", "--network=configs/recommender/movielens_autoencoder.json --input={missing} "
         "--checkpoint_path={out}", "--input {missing} does not exist"),
    Case("recommender_predict", "--checkpoint={missing} --input={dir} --output={out} --k=0", "--k=0"),
    Case("recommender_predict", "--checkpoint={ckpt_damaged} --input={dir} --output={out}",
         "meta.json: not readable as JSON"),
    Case("recommender_evaluate", "--heldout={dir}", "--input is required"),
    Case("recommender_evaluate", "--input={dir} --heldout={dir} --k=5,0 --output={out}", "every K must be >= 1"),
    Case("recommender_evaluate", "--input={dir} --heldout={dir} --baselines= --output={out}", "nothing to evaluate"),
    Case("recommender_evaluate", "--input={dir} --heldout={dir} --ease_lambda=0 --output={out}",
         "--ease_lambda 0: must be > 0"),
    Case("wide_train", "--batch_size=0 --save_checkpoint_path={out}", "--batch_size must be >= 1"),
    Case("wide_train", "--field_sizes=10,x --save_checkpoint_path={out}", "--field_sizes must be a comma-separated"),
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    import numpy as np

    from dlrm.data.synthetic import write_synthetic_dataset
    from preproc.generate import tsv_line

    root = tmp_path_factory.mktemp("cli_errors")
    p = {name: str(root / name) for name in ("missing", "file", "dir", "ckpt_damaged", "dataset", "truncated",
                                              "badspec", "tsv_bad", "tsv_latin1", "empty", "criteo", "criteo_bad",
                                              "csv", "csv_short", "spec_escape")}
    (root / "file").write_bytes(np.random.default_rng(0).integers(0, 256, 512, dtype=np.uint8).tobytes())
    os.mkdir(p["dir"])
    os.mkdir(p["ckpt_damaged"])
    (root / "ckpt_damaged" / "meta.json").write_text('{"format": 1, "config": ')
    for name in ("dataset", "truncated"):
        write_synthetic_dataset(p[name], 2, [5, 7], {"train": 64, "test": 32}, batch_size=64, seed=1)
    with open(os.path.join(p["truncated"], "test", "numerical.bin"), "r+b") as f:
        f.truncate(2 * 2 * 32 - 1)  # half a float16 short
    os.mkdir(p["badspec"])
    spec = open(os.path.join(p["dataset"], "feature_spec.yaml"), encoding="utf-8").read()
    (root / "badspec" / "feature_spec.yaml").write_bytes(("# caf\u00e9\n" + spec).encode("latin-1"))
    (root / "tsv_bad").write_text("1\t0.5\t3\n0\t1.5\tx\n")
    (root / "tsv_latin1").write_bytes("1\t0.5\t3\n0\t1.5\t4 caf\u00e9\n".encode("latin-1"))
    (root / "empty").write_bytes(b"")
    good = tsv_line("1", {0: "3"}, {0: "0123abcd"})
    (root / "criteo").write_text(good + "\n" + good + "\n")
    (root / "criteo_bad").write_text(good + "\n" + tsv_line("0", {4: "x"}) + "\n")
    # CSV sources (NVIDIA's transcoding layout): label+numerical in one file, ids in another; in
    # csv_short the ids file has a line fewer. csv_auto: the same spec with an 'auto' cardinality.
    csv_spec = {
        "channel_spec": {"categorical": ["c"], "numerical": ["n"], "label": ["y"]},
        "feature_spec": {"c": {"cardinality": 5}, "n": {}, "y": {}},
        "source_spec": {"train": [{"type": "csv", "features": ["y", "n"], "files": ["dense.csv"]},
                                  {"type": "csv", "features": ["c"], "files": ["ids.csv"]}]},
    }
    for name, ids in (("csv", "1\n2\n3\n"), ("csv_short", "1\n2\n")):
        os.mkdir(p[name])
        (root / name / "feature_spec.yaml").write_text(yaml.safe_dump(csv_spec))
        (root / name / "dense.csv").write_text("0,0.5\n1,1.5\n0,2.5\n")
        (root / name / "ids.csv").write_text(ids)
    csv_spec["feature_spec"]["c"]["cardinality"] = "auto"
    p["csv_auto"] = str(root / "csv_auto.yaml")
    (root / "csv_auto.yaml").write_text(yaml.safe_dump(csv_spec))
    escape = yaml.safe_load(open(os.path.join(p["dataset"], "feature_spec.yaml"), encoding="utf-8"))
    escape["source_spec"]["train"][0]["files"] = ["../outside.bin"]
    (root / "spec_escape").write_text(yaml.safe_dump(escape))
    return p


def _run(case: Case, paths: dict[str, str], out: str) -> subprocess.CompletedProcess:
    args = [piece.format(**paths, out=out) for piece in case.args.split()]
    return warm_python.run(
        [sys.executable, *CLIS[case.cli], *args], cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.fixture(scope="module")
def runs(request, paths, tmp_path_factory):
    """Starts every selected case of this module at once (PARALLEL at a time); case -> (future, out)."""
    cases = [item.callspec.params["case"] for item in request.session.items
             if item.module is request.module and "case" in getattr(getattr(item, "callspec", None), "params", {})]
    outputs = tmp_path_factory.mktemp("outputs")
    started: dict[Case, tuple[Future, str]] = {}
    with ThreadPoolExecutor(PARALLEL) as pool:
        for i, case in enumerate(dict.fromkeys(cases)):
            out = str(outputs / f"out{i}")
            started[case] = (pool.submit(_run, case, paths, out), out)
        yield started
        for future, _ in started.values():
            future.cancel()


def _result(runs, case: Case) -> tuple[subprocess.CompletedProcess, str]:
    future, out = runs[case]
    return future.result(), out


@pytest.mark.parametrize("case", HELP, ids=lambda c: c.id)
def test_help_lists_the_scripts_own_flags_and_exits_0(runs, case):
    proc, _ = _result(runs, case)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert case.expect in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    if case.cli != "preproc":  # absl: the script's flags only; absl's own (--verbosity) are under --helpfull
        assert "--verbosity" not in proc.stdout and "--helpfull" in proc.stdout
        assert proc.stdout.startswith(_docstring_first_line(case.cli))


def _docstring_first_line(cli: str) -> str:
    module = {"deployer": "dlrm.scripts.deploy", "client": "triton/client.py", "local_server": "triton/local_server.py"}
    name = module.get(cli, CLIS[cli][-1])
    if name.endswith(".py"):
        path = os.path.join(REPO, name)
    else:
        path = os.path.join(REPO, *name.split(".")) + ".py"
    with open(path) as f:
        return ast.get_docstring(ast.parse(f.read())).splitlines()[0]


@pytest.mark.parametrize("case", [Case("deployer", "--helpfull", "--verbosity", 0)], ids=lambda c: c.id)
def test_helpfull_lists_every_flag(runs, case):
    proc, _ = _result(runs, case)
    assert proc.returncode == 0, proc.stderr
    assert "--verbosity" in proc.stdout and "--model_repository" in proc.stdout


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_is_one_line_exit_2_no_traceback_no_output(runs, paths, case):
    proc, out = _result(runs, case)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    report = json.dumps({"status": proc.returncode, "stdout": proc.stdout[-2000:], "stderr": proc.stderr[-4000:]},
                        indent=1)
    assert "Traceback" not in proc.stdout + proc.stderr, report
    assert proc.returncode == case.status, report
    assert len(lines) == 1, report
    assert lines[0].startswith("error: "), report
    assert case.expect.format(**paths) in lines[0], report
    assert not os.path.exists(out), f"left behind: {[os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs]}"
