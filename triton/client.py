r"""Score a dataset split through a Triton Inference Server, and optionally soak it.

    python triton/client.py --url 127.0.0.1:8000 --model_name dlrm --dataset /data/criteo_fl15 \
        [--protocol http|grpc] [--split test] [--batch_size 4096] [--max_batches N] [--warmup_requests 10] \
        [--soak_seconds 10 --soak_streams 16 --soak_batch_size 64]      # the soak needs --protocol grpc

Prints throughput, latency percentiles and the AUC (the same as the checkpoint's offline AUC
when the server runs the deployed model); --log_path also writes them as JSON lines. When the
server cannot be reached, errs, lacks the model, or the shapes do not match the dataset, one line
names the server, the model and the fix, exit 2; a soak with failed requests exits 1.
--model_name takes Triton's model names (1 to 128 characters from A-Z a-z 0-9 _ . - not starting
with a dot) and --url host:port. Logic: dlrm/inference/triton_client.py.
"""

import json

from absl import app, flags

from dlrm.data.sources import DataConfig, load_feature_spec
from dlrm.data.split_binary import SplitBinaryReader
from dlrm.engine.errors import DatasetError
from dlrm.engine.outputs import LOG, claim_output, header_record
from dlrm.inference.triton_client import (PROTOCOLS, DLRMTritonClient, TritonClientError, check_url, score_split,
                                          soak)
from dlrm.scripts import cli, serving_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("url", None, "Server host:port (default: localhost:8000 for http, localhost:8001 for grpc).")
flags.DEFINE_enum("protocol", "http", list(PROTOCOLS), "Protocol to send requests with.")
flags.DEFINE_flag(serving_flags.model_name_flag("dlrm", "Model name in the server's repository."))
flags.DEFINE_string("dataset", None, "Split-binary dataset directory.")
flags.DEFINE_string("feature_spec", "feature_spec.yaml", "Feature spec inside --dataset (or an absolute path).")
flags.DEFINE_string("split", "test", "Split to score.")
flags.DEFINE_integer("batch_size", 4096, "Samples per request.", lower_bound=1)
flags.DEFINE_integer("max_batches", None, "Score only the first this many batches.", lower_bound=1)
flags.DEFINE_integer("warmup_requests", 10, "Untimed requests (the first batch) before scoring.", lower_bound=0)
flags.DEFINE_float("soak_seconds", 0, "After scoring, keep --soak_streams gRPC streams busy this long (0: no soak).",
                   lower_bound=0)
flags.DEFINE_integer("soak_streams", 16, "Concurrent gRPC streams in the soak.", lower_bound=1)
flags.DEFINE_integer("soak_batch_size", 64, "Samples per soak request (from the split's first batch).", lower_bound=1)
flags.DEFINE_float("timeout_s", 60, "Seconds to wait for the server per call.")
flags.DEFINE_string("log_path", None, "Append the results as JSON lines here (a new file, or a JSON-lines log this "
                    "program wrote; anything else is refused).")
flags.mark_flag_as_required("dataset")


def _ms(report) -> str:
    return f"mean {report.mean_ms:.2f}  p50 {report.p50_ms:.2f}  p90 {report.p90_ms:.2f}  p99 {report.p99_ms:.2f}"


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not FLAGS.timeout_s > 0:
        raise app.UsageError(f"--timeout_s must be positive, got {FLAGS.timeout_s}")
    if FLAGS.soak_seconds and FLAGS.protocol != "grpc":
        raise app.UsageError("--soak_seconds runs gRPC streams: add --protocol grpc (and the gRPC port in --url)")
    try:  # before the dataset is read: a mistyped --url fails at once, in one line
        url = check_url(FLAGS.url or ("localhost:8000" if FLAGS.protocol == "http" else "localhost:8001"),
                        FLAGS.protocol)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    if FLAGS.log_path:  # appended to: a log of this program's, or a new file (dlrm.engine.outputs), checked now
        claim_output(FLAGS.log_path, LOG, "log_path", inputs={"dataset": FLAGS.dataset}, keep=True)
    records = []
    # the server's errors (TritonClientError) and a bad --dataset: one line each, exit 2 (cli.run)
    spec = load_feature_spec(DataConfig(dataset=FLAGS.dataset, feature_spec=FLAGS.feature_spec))
    if FLAGS.split not in spec.splits:
        raise DatasetError(f"{FLAGS.dataset} has no split {FLAGS.split!r} (it has {sorted(spec.splits)})")
    with SplitBinaryReader(spec, FLAGS.split, FLAGS.batch_size) as reader, \
            DLRMTritonClient(url, FLAGS.model_name, FLAGS.protocol, FLAGS.timeout_s) as client:
        report = score_split(client, reader, FLAGS.max_batches, FLAGS.warmup_requests)
        print(f"{FLAGS.model_name} at {FLAGS.protocol}://{client.url}, split {FLAGS.split}: {report.samples} "
              f"samples in {report.requests} requests of up to {FLAGS.batch_size}")
        print(f"  auc {report.auc:.6f}  throughput {report.throughput:,.0f} samples/s  latency ms: {_ms(report)}")
        records.append({"type": "score", "split": FLAGS.split, "batch_size": FLAGS.batch_size,
                        "protocol": FLAGS.protocol, **report.summary()})
        first = reader.read_batch(0)
    soak_report = None
    if FLAGS.soak_seconds:
        rows = min(FLAGS.soak_batch_size, len(first))
        soak_report = soak(url, FLAGS.model_name, first.numerical[:rows].numpy(), first.categorical[:rows].numpy(),
                           FLAGS.soak_streams, FLAGS.soak_seconds, FLAGS.timeout_s)
        print(f"soak: {soak_report.streams} gRPC streams for {soak_report.seconds:.1f} s, batch {rows}: "
              f"{soak_report.requests} requests, {soak_report.errors} errors, "
              f"{soak_report.throughput:,.0f} samples/s  latency ms: {_ms(soak_report)}")
        for message in soak_report.first_errors:
            print(f"  error: {message}")
        records.append({"type": "soak", "batch_size": rows, **vars(soak_report)})
    if FLAGS.log_path:
        with open(FLAGS.log_path, "a") as log:
            if log.tell() == 0:  # a new log starts with this program's mark (dlrm.engine.outputs)
                records.insert(0, header_record())
            for record in records:
                log.write(json.dumps(record) + "\n")
    return 1 if soak_report is not None and soak_report.errors else 0


if __name__ == "__main__":
    cli.run(main, errors=(*cli.DEFAULT_ERRORS, TritonClientError))
