"""Sends DLRM inputs to a Triton Inference Server and measures what comes back.

``DLRMTritonClient`` connects over HTTP or gRPC, learns the model's tensor names, types and
shapes from the server (so it serves every repository flavour the deployer writes), and sends
binary tensors. ``score_split`` scores a dataset split batch by batch and reports latency,
throughput and the AUC; ``soak`` keeps many gRPC streams busy for a fixed time and counts
errors. Failures name the server URL, the model and, for shapes, what was expected and got;
every error the server or the connection can give becomes a ``TritonClientError`` of one line
(what the server said is cut short: it is text from outside). Model names are checked
(``dlrm.inference.model_names``) before they reach a URL.

Needs ``tritonclient[grpc,http]`` (the ``serving`` extra).
"""

from __future__ import annotations

import ipaddress
import queue
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dlrm.data.metrics import roc_auc
from dlrm.inference.export import INPUT_NAMES, OUTPUT_NAME
from dlrm.inference.model_names import check_model_name, model_path

PROTOCOLS = ("http", "grpc")
NUMPY_TYPES = {"FP32": np.float32, "FP16": np.float16, "INT64": np.int64}


class TritonClientError(RuntimeError):
    """The server cannot be reached, lacks the model, or the model does not fit the data."""


_SAID = 160  # characters of a server's or library's message quoted in an error


def said(error: BaseException) -> str:
    """What an exception from the server's side says, on one line and cut short, for a message."""
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= _SAID else text[:_SAID] + "..."


# Methods of tritonclient's clients -> the request they make, as messages name it ("{}": the model).
_REQUESTS = {
    "is_server_live": "GET v2/health/live", "is_model_ready": "GET {}/ready", "get_model_metadata": "GET {}",
    "get_model_config": "GET {}/config", "get_model_repository_index": "POST v2/repository/index",
    "infer": "POST {}/infer",
}


def _protocol_module(protocol: str) -> Any:
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    try:
        if protocol == "http":
            import tritonclient.http as module
        else:
            import tritonclient.grpc as module
    except ImportError as e:
        raise TritonClientError(f"the {protocol} client needs tritonclient[grpc,http] ({e}): "
                                "pip install -e '.[serving]'") from e
    return module


_URL = re.compile(r"(?:(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://)?(?P<host>\[[^\]/]*\]|[^:/\[\]]*)(?::(?P<port>[^/]*))?/*")
_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)(?:\.(?!-)[A-Za-z0-9_-]{1,63}(?<!-))*\.?")


def check_url(url: str, protocol: str) -> str:
    """The server address ``url`` as tritonclient takes it, ``host:port``, after checking it:
    ``[scheme://]host:port[/]`` with the scheme, if given, the protocol's own (``http://`` or
    ``grpc://``), the host a name, an IPv4 address or an IPv6 address in brackets, and the port a
    number in 1..65535 (Triton listens on 8000 for HTTP, 8001 for gRPC). Anything else raises a
    ValueError naming `url`, before any connection is tried."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    example = "localhost:8000" if protocol == "http" else "localhost:8001"
    where = f"`url` {url!r}:"
    fix = f"give host:port, e.g. {example}"
    match = _URL.fullmatch(url) if isinstance(url, str) else None
    if match is None:
        unclosed = isinstance(url, str) and "[" in url and "]" not in url
        raise ValueError(f"{where} {'the [ of an IPv6 address is not closed' if unclosed else 'not a server address'}; "
                         f"{fix}")
    scheme, host, port = match.group("scheme"), match.group("host"), match.group("port")
    if scheme is not None and scheme.lower() != protocol:
        why = ("this client speaks plain HTTP and gRPC, without TLS" if scheme.lower() == "https"
               else f"it does not match `protocol={protocol}`" if scheme.lower() in PROTOCOLS
               else "the schemes are http:// and grpc://")
        raise ValueError(f"{where} the scheme {scheme}:// is not {protocol}://: {why}; {fix}")
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"{where} {host} is not an IPv6 address; {fix} (an IPv6 address in brackets: "
                             f"[::1]:{example.split(':')[1]})") from None
    elif not host:
        raise ValueError(f"{where} no host; {fix}")
    elif not _HOST_NAME.fullmatch(host) or len(host) > 253:
        raise ValueError(f"{where} {host!r} is not a host name or an IP address; {fix}")
    elif host.rstrip(".").replace(".", "").isdigit():  # numbers only: an IPv4 address or nothing
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"{where} {host} is not an IPv4 address; {fix}") from None
    if port is None or port == "":
        raise ValueError(f"{where} no port; {fix}")
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ValueError(f"{where} the port {port!r} is not a number in 1..65535; {fix}")
    return f"{host}:{int(port)}"


def _pick(tensors: list[dict], name: str, what: str, where: str) -> dict:
    """The tensor called ``name``, or ``name__<index>`` (the libtorch backend's convention)."""
    for tensor in tensors:
        if tensor["name"] == name or tensor["name"].startswith(f"{name}__"):
            return tensor
    names = ascii([t["name"] for t in tensors])
    raise TritonClientError(f"{where} has no {what} named {name!r} (it has {names[:_SAID]}): "
                            "deploy it with triton/deployer.py")


@dataclass(frozen=True)
class ModelSignature:
    """The model's tensors as the server reports them (batch dimension left out)."""

    numerical: str
    numerical_datatype: str  # "FP32" or "FP16"
    categorical: str
    output: str
    num_numerical: int
    num_categorical: int
    max_batch_size: int  # 0: the model does not batch (never the case for deployed DLRMs)


class DLRMTritonClient:
    """One connection to one model. ``infer(numerical, categorical) -> probabilities [B]``.

    The constructor checks, in order, that the server answers, that the model is ready, and
    that its metadata describe a DLRM; each failure raises ``TritonClientError`` with the URL.
    """

    def __init__(self, url: str, model_name: str, protocol: str = "http", timeout_s: float = 60.0) -> None:
        self.url = check_url(url, protocol)  # before the client library, which fails on a bad one noisily
        self.model_name = check_model_name(model_name)  # it goes into URLs: never "..", "/" or "?"
        self.module = _protocol_module(protocol)
        self.protocol = protocol
        self.where = f"model {model_name!r} on the Triton server at {protocol}://{self.url}"
        self.timeout_s = timeout_s
        if protocol == "http":
            self.client = self.module.InferenceServerClient(
                self.url, connection_timeout=timeout_s, network_timeout=timeout_s)
        else:
            self.client = self.module.InferenceServerClient(self.url)
        try:
            self._check_server()
            self.signature = self._read_signature()
        except BaseException:
            self.close()
            raise

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One request through the client library; whatever fails (the connection, an HTTP or gRPC
        error, an answer that is not JSON) becomes one ``TritonClientError`` naming the request."""
        if self.protocol == "grpc":
            kwargs.setdefault("client_timeout", self.timeout_s)
        try:
            return getattr(self.client, method)(*args, **kwargs)
        except Exception as e:  # each client library (and its HTTP or gRPC stack) has its own types
            raise self._failed(method, e) from e

    def _failed(self, method: str, error: Exception) -> TritonClientError:
        request = _REQUESTS.get(method, method).format(model_path(self.model_name))
        server = f"{self.protocol}://{self.url}"
        if isinstance(error, (ConnectionError, TimeoutError, OSError)) and not isinstance(error, ConnectionResetError):
            return TritonClientError(f"cannot reach the Triton server at {server} ({request}: {said(error)}): is it "
                                     f"running, and is that its {self.protocol} port?")
        return TritonClientError(f"the Triton server at {server} failed {request} ({said(error)}): see the server's "
                                 f"log; is that a Triton server, and did model {self.model_name!r} load?")

    def _json(self, method: str, *args: Any) -> Any:
        return self._call(method, *args, **({"as_json": True} if self.protocol == "grpc" else {}))

    def _check_server(self) -> None:
        try:
            live = self._call("is_server_live")
        except TritonClientError as e:  # connection refused, DNS, timeouts: no server there
            cause = e.__cause__ if isinstance(e.__cause__, Exception) else e
            raise TritonClientError(f"cannot reach the Triton server at {self.protocol}://{self.url} "
                                    f"({said(cause)}): is it running, and is that its {self.protocol} port?") from e
        if not live:
            raise TritonClientError(f"the Triton server at {self.protocol}://{self.url} is not live")
        if not self._call("is_model_ready", self.model_name):
            raise TritonClientError(f"{self.where} is missing or not ready (the server lists: {self._listing()}): "
                                    "check `model_name`, and the server's log for why the model did not load")

    def _listing(self) -> str:
        """The server's models and their states, cut short, for a message (or why it is unknown)."""
        try:
            index = self._json("get_model_repository_index")
            models = index.get("models", []) if isinstance(index, dict) else index
            listing = ", ".join(f"{m['name']} ({m.get('state', 'unknown')})" for m in models) or "none"
        except Exception as e:
            cause = e.__cause__ if isinstance(e.__cause__, Exception) else e
            return f"unknown, {said(cause)}"
        listing = " ".join(listing.split())
        return listing if len(listing) <= _SAID else listing[:_SAID] + "..."

    def _read_signature(self) -> ModelSignature:
        metadata = self._json("get_model_metadata", self.model_name)
        config = self._json("get_model_config", self.model_name)
        try:
            return self._signature(metadata, config)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:  # fields missing or mistyped
            raise TritonClientError(f"{self.where} answered metadata or a config this client cannot read "
                                    f"({said(e)}): is that a Triton server, and a model triton/deployer.py "
                                    "wrote?") from e

    def _signature(self, metadata: Any, config: Any) -> ModelSignature:
        """The signature from the server's answers (JSON as dicts; fields checked as used)."""
        config = config.get("config", config)  # gRPC wraps it
        numerical = _pick(metadata["inputs"], INPUT_NAMES[0], "input", self.where)
        categorical = _pick(metadata["inputs"], INPUT_NAMES[1], "input", self.where)
        output = _pick(metadata["outputs"], OUTPUT_NAME, "output", self.where)
        if numerical["datatype"] not in ("FP32", "FP16") or categorical["datatype"] != "INT64":
            raise TritonClientError(f"{self.where} takes {ascii(numerical['datatype'])[:20]} numerical and "
                                    f"{ascii(categorical['datatype'])[:20]} categorical inputs; expected FP32 or FP16, "
                                    "and INT64")
        dims = {}
        for tensor in (numerical, categorical):
            shape = [int(d) for d in tensor["shape"]]
            if len(shape) != 2:
                raise TritonClientError(f"{self.where}: input {ascii(tensor['name'])[:60]} has shape {shape[:8]}, "
                                        "expected [batch, features]")
            dims[tensor["name"]] = shape[1]
        return ModelSignature(
            numerical=numerical["name"], numerical_datatype=numerical["datatype"],
            categorical=categorical["name"], output=output["name"],
            num_numerical=dims[numerical["name"]], num_categorical=dims[categorical["name"]],
            max_batch_size=int(config.get("max_batch_size", 0)),
        )

    def check_features(self, num_numerical: int, num_categorical: int) -> None:
        """Raise ``TritonClientError`` unless the model takes this many features of each kind."""
        s = self.signature
        if (s.num_numerical, s.num_categorical) != (num_numerical, num_categorical):
            raise TritonClientError(
                f"shape mismatch: {self.where} expects numerical [batch, {s.num_numerical}] and categorical "
                f"[batch, {s.num_categorical}], got numerical [batch, {num_numerical}] and categorical "
                f"[batch, {num_categorical}]: was the model trained on this dataset?"
            )

    def inputs(self, numerical: np.ndarray, categorical: np.ndarray) -> list:
        """Binary ``InferInput``s in the model's types, after checking shapes and batch size."""
        if numerical.ndim != 2 or categorical.ndim != 2 or len(numerical) != len(categorical):
            raise TritonClientError(f"inputs for {self.where} must be [batch, features] with one batch size, got "
                                    f"numerical {list(numerical.shape)} and categorical {list(categorical.shape)}")
        self.check_features(numerical.shape[1], categorical.shape[1])
        if self.signature.max_batch_size and len(numerical) > self.signature.max_batch_size:
            raise TritonClientError(f"batch of {len(numerical)} exceeds max_batch_size "
                                    f"{self.signature.max_batch_size} of {self.where}")
        s = self.signature
        arrays = [(s.numerical, s.numerical_datatype, numerical), (s.categorical, "INT64", categorical)]
        inputs = []
        for name, datatype, array in arrays:
            tensor = self.module.InferInput(name, list(array.shape), datatype)
            data = np.ascontiguousarray(array, dtype=NUMPY_TYPES[datatype])
            if self.protocol == "http":
                tensor.set_data_from_numpy(data, binary_data=True)
            else:
                tensor.set_data_from_numpy(data)
            inputs.append(tensor)
        return inputs

    def outputs(self) -> list:
        if self.protocol == "http":
            return [self.module.InferRequestedOutput(self.signature.output, binary_data=True)]
        return [self.module.InferRequestedOutput(self.signature.output)]

    def infer(self, numerical: np.ndarray, categorical: np.ndarray) -> np.ndarray:
        """Click probabilities ``[B]`` for one batch."""
        inputs = self.inputs(numerical, categorical)
        result = self._call("infer", self.model_name, inputs, outputs=self.outputs())
        out = result.as_numpy(self.signature.output)
        if out is None or out.shape != (len(numerical), 1):
            got = None if out is None else list(out.shape)
            raise TritonClientError(f"{self.where} returned {self.signature.output!r} of shape {got}, "
                                    f"expected [{len(numerical)}, 1]")
        return out[:, 0]

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # closing twice, or after a failed connect
            pass

    def __enter__(self) -> "DLRMTritonClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _percentiles_ms(latencies_s: Iterable[float]) -> dict[str, float]:
    ms = np.asarray(list(latencies_s), dtype=np.float64) * 1e3
    if ms.size == 0:
        return {"mean_ms": float("nan"), "p50_ms": float("nan"), "p90_ms": float("nan"), "p99_ms": float("nan")}
    return {"mean_ms": float(ms.mean()), "p50_ms": float(np.percentile(ms, 50)),
            "p90_ms": float(np.percentile(ms, 90)), "p99_ms": float(np.percentile(ms, 99))}


@dataclass
class ScoreReport:
    """What ``score_split`` measured: one request per batch, sent one after the other."""

    samples: int
    requests: int
    seconds: float
    throughput: float  # samples/s over the whole run
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    auc: float
    scores: np.ndarray = field(repr=False)
    labels: np.ndarray = field(repr=False)

    def summary(self) -> dict[str, float]:
        return {k: v for k, v in vars(self).items() if not isinstance(v, np.ndarray)}


def score_split(client: DLRMTritonClient, reader: Any, max_batches: int | None = None, warmup: int = 0) -> ScoreReport:
    """Scores the batches of ``reader`` (a ``SplitBinaryReader``: ``len()`` and ``read_batch``)
    through the server; the AUC is over every sample sent. ``warmup`` untimed requests of the
    first batch go first, so the figures do not carry the server's first-call costs."""
    client.check_features(reader.spec.num_numerical, reader.spec.num_categorical)
    count = len(reader) if max_batches is None else min(len(reader), max_batches)
    if warmup and count:
        first = reader.read_batch(0)
        for _ in range(warmup):
            client.infer(first.numerical.numpy(), first.categorical.numpy())
    scores, labels, latencies = [], [], []
    start = time.perf_counter()
    for index in range(count):
        batch = reader.read_batch(index)
        numerical, categorical = batch.numerical.numpy(), batch.categorical.numpy()
        sent = time.perf_counter()
        scores.append(client.infer(numerical, categorical))
        latencies.append(time.perf_counter() - sent)
        labels.append(batch.label.numpy().reshape(-1))
    seconds = time.perf_counter() - start
    all_scores = np.concatenate(scores) if scores else np.empty(0, np.float32)
    all_labels = np.concatenate(labels).astype(np.float64) if labels else np.empty(0)
    auc = roc_auc(torch.from_numpy(all_labels), torch.from_numpy(all_scores)) if len(all_scores) else float("nan")
    return ScoreReport(samples=len(all_scores), requests=count, seconds=seconds,
                       throughput=len(all_scores) / seconds if seconds > 0 else float("nan"),
                       auc=auc, scores=all_scores, labels=all_labels, **_percentiles_ms(latencies))


@dataclass
class SoakReport:
    """What ``soak`` measured across all streams."""

    streams: int
    seconds: float
    requests: int
    samples: int
    errors: int
    throughput: float  # samples/s
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    first_errors: list[str] = field(default_factory=list)


def soak(
    url: str, model_name: str, numerical: np.ndarray, categorical: np.ndarray,
    streams: int = 16, seconds: float = 5.0, timeout_s: float = 60.0,
) -> SoakReport:
    """Keeps ``streams`` gRPC streams busy for ``seconds``, each with one request in flight at a
    time (send, wait for the response, send again), all sending the same batch.

    Every stream has its own client and bidirectional gRPC stream. A request counts as an error
    when the server answers with one, when the answer is not a probability per sample, or when
    no answer arrives within ``timeout_s``.
    """
    clients: list[DLRMTritonClient] = []
    try:
        for _ in range(streams):
            clients.append(DLRMTritonClient(url, model_name, "grpc", timeout_s))
    except BaseException:
        for client in clients:
            client.close()
        raise
    lock = threading.Lock()
    latencies: list[float] = []
    errors: list[str] = []
    counts = {"requests": 0, "samples": 0}
    start_line = threading.Barrier(streams + 1)
    deadline_box: list[float] = []

    def worker(client: DLRMTritonClient, answers: queue.Queue, inputs: list, outputs: list) -> None:
        own_latencies, own_errors, sent = [], [], 0
        try:
            start_line.wait(timeout=timeout_s)
            deadline = deadline_box[0]
            while time.monotonic() < deadline:
                begin = time.perf_counter()
                client.client.async_stream_infer(client.model_name, inputs, outputs=outputs, request_id=str(sent))
                sent += 1
                try:
                    result, error = answers.get(timeout=timeout_s)
                except queue.Empty:
                    own_errors.append(f"no answer within {timeout_s} s")
                    break  # the stream is stuck: a late answer would be matched to the wrong request
                if error is not None:
                    own_errors.append(said(error))
                    continue
                out = result.as_numpy(client.signature.output)
                if out is None or out.shape != (len(numerical), 1) or not np.isfinite(out).all():
                    own_errors.append(f"bad output {None if out is None else out.shape}")
                    continue
                own_latencies.append(time.perf_counter() - begin)
        except Exception as e:
            own_errors.append(said(e))
        finally:
            client.client.stop_stream()
        with lock:
            latencies.extend(own_latencies)
            errors.extend(own_errors)
            counts["requests"] += sent
            counts["samples"] += len(own_latencies) * len(numerical)

    threads = []
    try:
        for i, client in enumerate(clients):
            answers: queue.Queue = queue.Queue()
            args = (client, answers, client.inputs(numerical, categorical), client.outputs())
            client.client.start_stream(callback=lambda result, error, answers=answers: answers.put((result, error)))
            threads.append(threading.Thread(target=worker, args=args, name=f"soak-{i}"))
        for thread in threads:
            thread.start()
        deadline_box.append(time.monotonic() + seconds)
        began = time.perf_counter()
        start_line.wait(timeout=timeout_s)
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - began
    finally:
        for client in clients:
            client.close()
    return SoakReport(streams=streams, seconds=elapsed, requests=counts["requests"], samples=counts["samples"],
                      errors=len(errors), throughput=counts["samples"] / elapsed, first_errors=errors[:5],
                      **_percentiles_ms(latencies))
