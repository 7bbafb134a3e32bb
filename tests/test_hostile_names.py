"""Model names go into a config.pbtxt, a repository folder and server URLs: one rule checks them
where they enter (R2), one function escapes every string of the config, and the config is read
back before a deploy says it is done. The Triton client turns every error a server or the
connection can give into one line naming the server, the model and the fix, exit 2 (R16), here
against a real HTTP server that misbehaves in each way."""

import http.server
import json
import os
import threading
import urllib.parse

import pytest
import torch
from conftest import tree, run_entry_points
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm.inference.model_names import ModelNameError, check_model_name, model_path, pbtxt_string, url_segment
from dlrm.inference.pbtxt import ConfigCheckError, check_config, read_protobuf, read_subset
from dlrm.inference.triton_repository import TritonModelConfig, intended_summary, render_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULE = "A-Z a-z 0-9 _ . -"
INJECTION = 'dlrm"\nparameters { key: "EXECUTION_ENV_PATH" value: { string_value: "evil.tar.gz" } }\n#'


def run_cases(module: str, preload: list[str], cases: list[dict], tmp_path) -> list[dict]:
    """Each case as ``python -m module args`` (tests/entry_point_runner.py: one start, a fork each)."""
    return run_entry_points(module, cases, tmp_path, preload=preload, timeout=300)


def assert_one_line(result: dict, *needles: str) -> str:
    lines = result["stderr"].strip().splitlines()
    assert result["returncode"] == 2 and len(lines) == 1, result
    assert "Traceback" not in result["stderr"] and all(n in lines[0] for n in needles), (needles, lines[0])
    return lines[0]


# ---------------------------------------------------------------------------- R2: deploy


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from dlrm.model.dlrm import DLRM, DLRMConfig
    from dlrm.training.checkpoint import TrainState, save_checkpoint

    torch.manual_seed(0)
    config = DLRMConfig(num_numerical_features=2, table_sizes=[5, 7], embedding_dim=4, bottom_mlp_sizes=[8, 4],
                        top_mlp_sizes=[8, 1])
    path = str(tmp_path_factory.mktemp("ck") / "ck")
    save_checkpoint(path, DLRM(config).eval(), None, None, TrainState())
    return path


def test_r2_hostile_model_names_are_refused_before_anything_is_written(checkpoint, tmp_path):
    """R2: the injection wrote a parameter of its own into config.pbtxt and 'a"b' a config that
    does not parse, both exit 0. Now: one line naming the flag and the rule, exit 2, the tree as
    it was; the same command with a good name deploys a config that reads back to that name."""
    home = tmp_path / "home"
    (home / "R").mkdir(parents=True)
    common = ["--checkpoint", checkpoint, "--model_repository", str(home / "R"), "--instance_kind", "cpu",
              "--python_backend", "--format=torchscript", "--check_batch_sizes=1"]
    names = [INJECTION, 'a"b', "..", "../escape", "x" * 129, ""]
    cases = [{"args": [*common, "--model_name", name], "cwd": str(home)} for name in names]
    cases.append({"args": [*common, "--model_name", "ctr.v2-b_1"], "cwd": str(tmp_path)})
    before = tree(home)
    *refused, control = run_cases("dlrm.scripts.deploy", ["dlrm.inference.export", "dlrm.scripts.cli"], cases, tmp_path)
    for name, result in zip(names, refused):
        line = assert_one_line(result, "--model_name", RULE)
        assert "EXECUTION_ENV_PATH" not in line and len(line) < 400, (name, line)
    assert control["returncode"] == 0, control["stderr"]
    after = {k: v for k, v in tree(home).items() if not k.startswith(os.path.join("R", "ctr.v2-b_1"))}
    assert after == before, "a refused deploy changed the tree"
    text = (home / "R" / "ctr.v2-b_1" / "config.pbtxt").read_text()
    assert read_subset(text).name == "ctr.v2-b_1" and read_protobuf(text).name == "ctr.v2-b_1"


def test_api_configs_check_names_and_a_config_that_reads_back_wrong_is_refused():
    for name in ("a/b", "..", ".hidden", "a b", "é", 'q"', 7):
        with pytest.raises(ModelNameError, match="not a model name"):
            TritonModelConfig(model_name=name)
    cfg = TritonModelConfig(model_name="m", python_backend=True)
    text = render_config(cfg, 2, 2)
    check_config(text, intended_summary(cfg, 2, 2))
    for tampered in (text.replace('name: "m"', 'name: "n"'), text + "}", text.replace("dims: [ 2 ]", "dims: [ 3 ]"),
                     text + 'parameters { key: "EXECUTION_ENV_PATH" value: { string_value: "e" } }\n',
                     text + "unknown_key: 1\n"):
        with pytest.raises(ConfigCheckError):
            check_config(tampered, intended_summary(cfg, 2, 2))
        try:  # the strict reader alone (used without tritonclient) sees it too
            assert read_subset(tampered) != intended_summary(cfg, 2, 2)
        except ConfigCheckError:
            pass


# ---------------------------------------------------------------------------- names, generated


ADVERSARIAL = st.text(alphabet=st.sampled_from(list('"\\\'\n\r\t\x00\x7f./?%#{}[]: é\u2028-_aZ09')), max_size=40)
GOOD = st.from_regex(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}", fullmatch=True)


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text(max_size=140), ADVERSARIAL, GOOD))
def test_every_name_round_trips_or_is_refused_in_one_line(name):
    try:
        check_model_name(name)
    except ModelNameError as e:
        message = str(e)
        assert "\n" not in message and "\r" not in message and len(message) < 400 and RULE in message
        assert message.isascii()
        return
    text = render_config(TritonModelConfig(model_name=name, python_backend=True, instance_kind="cpu"), 2, 2)
    assert read_subset(text).name == name and read_protobuf(text).name == name
    segment = url_segment(name)
    assert "/" not in segment and "?" not in segment and urllib.parse.unquote(segment) == name
    assert model_path(name) == f"v2/models/{segment}"


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
def test_every_string_is_escaped_so_it_reads_back_as_itself(value):
    """Defence in depth: whatever a string holds, ``pbtxt_string`` keeps it one string."""
    text = (f"name: {pbtxt_string('m')}\nparameters {{ key: {pbtxt_string(value)} value: {{ string_value: "
            f"{pbtxt_string(value)} }} }}\n")
    assert read_subset(text).parameters == {value: value} == read_protobuf(text).parameters


# ---------------------------------------------------------------------------- R16: the client


META = {"inputs": [{"name": "numerical", "datatype": "FP32", "shape": [-1, 2]},
                   {"name": "categorical", "datatype": "INT64", "shape": [-1, 2]}],
        "outputs": [{"name": "click_probability", "datatype": "FP32", "shape": [-1, 1]}]}


class MisbehavingTriton(http.server.BaseHTTPRequestHandler):
    """Live and ready; then each model fails in its own way (its name says how)."""

    protocol_version = "HTTP/1.1"
    seen: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def answer(self) -> None:
        self.seen.append(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        parts = self.path.strip("/").split("/")
        model = parts[2] if len(parts) > 2 and parts[:2] == ["v2", "models"] else ""
        rest = parts[3:]
        if self.path.startswith("/v2/health/"):
            return self.reply(200, b"")
        if model == "notready" and rest == ["ready"] or self.path.startswith("/v2/repository/"):
            return self.reply(500, b'{"error": "internal"}')
        if rest == ["ready"]:
            return self.reply(200, b"")
        if model == "meta500" or (model == "infer500" and rest == ["infer"]):
            return self.reply(500, json.dumps({"error": "boom\n" * 200}).encode())
        if model == "metajunk":
            return self.reply(200, b"{not json")
        if model == "metatyped":
            return self.reply(200, b'{"inputs": "x", "outputs": 3}')
        if model == "metaclose":
            self.close_connection = True
            return None
        return self.reply(200, json.dumps(META if not rest else {"max_batch_size": 64}).encode())

    do_GET = do_POST = answer


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), MisbehavingTriton)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from dlrm.data.synthetic import write_synthetic_dataset

    path = str(tmp_path_factory.mktemp("client") / "data")
    write_synthetic_dataset(path, 2, [5, 5], {"train": 8, "test": 8}, batch_size=8)
    return path


def closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


def test_r16_every_server_error_is_one_line_exit_2(server, dataset, tmp_path):
    """R16: HTTP 500 on the metadata call after the readiness check printed a 33-line
    InferenceServerException traceback (exit 1)."""
    models = ["meta500", "metajunk", "metatyped", "metaclose", "notready", "infer500"]
    cases = [{"args": ["--url", server, "--model_name", m, "--dataset", dataset, "--timeout_s", "5"],
              "cwd": str(tmp_path)} for m in models]
    refused_port = closed_port()
    cases.append({"args": ["--url", f"127.0.0.1:{refused_port}", "--dataset", dataset, "--timeout_s", "5"],
                  "cwd": str(tmp_path)})
    hostile = "../../repository/models/x/unload?y="
    cases.append({"args": ["--url", server, "--model_name", hostile, "--dataset", dataset], "cwd": str(tmp_path)})
    cases.append({"args": ["--url", f"{server}/../v2", "--dataset", dataset], "cwd": str(tmp_path)})
    MisbehavingTriton.seen.clear()
    results = run_cases(os.path.join(REPO, "triton", "client.py"), ["dlrm.inference.triton_client", "tritonclient.http"],
                        cases, tmp_path)
    *served, refused, named, pathed = results
    for model, result in zip(models, served):
        line = assert_one_line(result, f"http://{server}", model)
        assert len(line) < 600 and ("log" in line or "deployer" in line), line
    assert_one_line(refused, f"127.0.0.1:{refused_port}", "is it running")
    assert_one_line(named, "--model_name", RULE)
    assert_one_line(pathed, "--url")
    assert not any("unload" in path or ".." in path for path in MisbehavingTriton.seen), MisbehavingTriton.seen


def test_client_api_checks_the_name_before_connecting(server):
    from dlrm.inference.triton_client import DLRMTritonClient

    MisbehavingTriton.seen.clear()
    for name in ("../x", "a?b", "", ".", "a/b"):
        with pytest.raises(ModelNameError, match="not a model name"):
            DLRMTritonClient(server, name)
    assert MisbehavingTriton.seen == []


def test_a_failed_deploy_leaves_nothing_half_written(tmp_path):
    """The exported file is written before its check against eager: when that check fails, the
    file goes with the folders the deploy made (before, model.pt stayed without a config)."""
    from dlrm.inference.triton_repository import deploy_model
    from dlrm.model.dlrm import DLRM, DLRMConfig

    model = DLRM(DLRMConfig(num_numerical_features=2, table_sizes=[5, 7], embedding_dim=4, bottom_mlp_sizes=[8, 4],
                            top_mlp_sizes=[8, 1])).eval()
    cfg = TritonModelConfig(model_name="m", format="torchscript", instance_kind="cpu")
    with pytest.raises(RuntimeError):
        deploy_model(model, str(tmp_path / "R"), cfg, check_batch_sizes=(-1,))  # no batch of -1 rows
    assert tree(tmp_path) == {}
