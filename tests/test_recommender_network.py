"""DSSTNE network-definition parser: the shipped MovieLens config, the rules, and every error class."""

import copy
import dataclasses
import json
import os

import pytest

from dlrm.recommender.network import (
    ACTIVATIONS,
    ERROR_FUNCTIONS,
    OPTIMIZERS,
    WEIGHT_SCHEMES,
    Layer,
    NetworkConfig,
    NetworkConfigError,
    Optimizer,
    Variational,
    WeightInit,
    parse_network,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(REPO, "configs", "recommender", "movielens_autoencoder.json")
MULT_DAE = os.path.join(REPO, "configs", "recommender", "mult_dae.json")
MULT_VAE = os.path.join(REPO, "configs", "recommender", "mult_vae.json")


def minimal(**top) -> dict:
    """A small valid network; tests change one thing in it."""
    net = {
        "Kind": "AutoEncoder",
        "Layers": [
            {"Kind": "Input", "N": "auto", "DataSet": "items", "Sparse": True},
            {"Kind": "Hidden", "N": 16, "Activation": "Relu"},
            {"Kind": "Output", "N": "auto", "DataSet": "items", "Activation": "Sigmoid"},
        ],
    }
    net.update(top)
    return net


def write(tmp_path, obj, name="net.json") -> str:
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj, indent=2))
    return str(path)


def error_of(source) -> str:
    with pytest.raises(NetworkConfigError) as info:
        parse_network(source)
    return str(info.value)


# --------------------------------------------------------------------------------------------
# The shipped sample, field by field, against the user guide's MovieLens values.

def test_sample_config_every_field():
    cfg = parse_network(SAMPLE)
    assert cfg.source == SAMPLE
    assert cfg.name == "MovieLens autoencoder"
    assert cfg.kind == "autoencoder"
    assert cfg.shuffle_indices is False
    assert (cfg.sparseness_p, cfg.sparseness_beta) == (0.5, 2.0)
    assert cfg.denoising_p == 0.2
    assert (cfg.one_target, cfg.zero_target, cfg.one_scale, cfg.zero_scale) == (1.0, 0.0, 1.0, 1.0)
    assert cfg.error_function == "scaledmarginalcrossentropy"
    assert cfg.optimizer == Optimizer()  # no Optimizer block: this project's defaults
    assert [layer.kind for layer in cfg.layers] == ["input", "hidden", "output"]

    assert cfg.input == Layer(kind="input", name="Input", n=None, sparse=True, dataset="gl_input")
    (hidden,) = cfg.hidden
    assert hidden == Layer(kind="hidden", name="Hidden", n=128, sparse=True, dataset=None, activation="sigmoid",
                           p_dropout=0.0, weight_init=WeightInit("xavier", 1.0, 0.0), sparseness_penalty=False)
    assert cfg.output == Layer(kind="output", name="Output", n=None, sparse=True, dataset="gl_output",
                               activation="sigmoid")


@pytest.mark.parametrize("path", [MULT_DAE, MULT_VAE])
def test_mult_dae_and_mult_vae_configs(path):
    """Liang et al.'s architectures: I -> 600 -> 200 -> 600 -> I, tanh, a multinomial likelihood
    over the catalogue, L2-normalised input with dropout 0.5, Adam 1e-3."""
    cfg = parse_network(path)
    assert cfg.kind == "autoencoder" and cfg.input_normalization == "l2" and cfg.input.p_dropout == 0.5
    assert [layer.n for layer in cfg.hidden] == [600, 200, 600]
    assert (cfg.output.activation, cfg.error_function) == ("softmax", "crossentropy")
    assert (cfg.optimizer.kind, cfg.optimizer.alpha) == ("adam", 0.001)
    assert parse_network(cfg.to_json()) == cfg
    if path == MULT_DAE:
        assert [layer.activation for layer in cfg.hidden] == ["tanh"] * 3 and cfg.variational is None
        assert cfg.optimizer.lambda_ == 0.00004  # the authors' code: 2 x 0.01 / batch 500 on the weights
    else:
        assert [layer.activation for layer in cfg.hidden] == ["tanh", "linear", "tanh"]
        assert cfg.variational == Variational("Latent", beta=0.2, anneal_steps=40000) and cfg.optimizer.lambda_ == 0


def test_variational_block_defaults_and_errors():
    net = minimal(Variational={})
    net["Layers"][1:1] = [{"Kind": "Hidden", "N": 32, "Activation": "Tanh"}]
    net["Layers"][2]["Activation"] = "Linear"  # the 16-unit layer: the narrowest is the latent by default
    cfg = parse_network(net)
    assert cfg.variational == Variational("Hidden2", beta=1.0, anneal_steps=0)
    assert parse_network(cfg.to_json()) == cfg
    assert parse_network(minimal()).variational is None and parse_network(minimal()).input_normalization == "none"
    net["Layers"][2]["Activation"] = "Tanh"
    assert "`Layers[2].Activation`" in (m := error_of(net)) and '"Activation": "Linear"' in m
    for block, path, needle in [({"Layer": "Input"}, "Variational.Layer", "not a Hidden layer; use one of Hidden1"),
                                ({"AnnealSteps": -1}, "Variational.AnnealSteps", "integer >= 0"),
                                ({"AnnealSteps": 2.5}, "Variational.AnnealSteps", "integer >= 0"),
                                ({"Beta": -0.1}, "Variational.Beta", ">= 0"),
                                ({"Beta": 0.2, "Anneal": 5}, "Variational.Anneal", "did you mean 'AnnealSteps'")]:
        linear = minimal(Variational=block)
        linear["Layers"][1]["Activation"] = "Linear"
        assert f"`{path}`" in (m := error_of(linear)) and needle in m
    no_hidden = {"Layers": [{"Kind": "Input", "N": 5, "DataSet": "d"}, {"Kind": "Output", "N": 5}], "Variational": {}}
    assert "needs a Hidden layer" in error_of(no_hidden)


def test_input_normalization_values():
    assert parse_network(minimal(InputNormalization="l2")).input_normalization == "l2"
    assert parse_network(minimal(InputNormalization="None")).input_normalization == "none"
    assert "`InputNormalization`" in (m := error_of(minimal(InputNormalization="L1"))) and "None, L2" in m


def test_contract_constants():
    assert ACTIVATIONS == ("sigmoid", "tanh", "relu", "lrelu", "elu", "selu", "softplus", "linear", "softmax")
    assert ERROR_FUNCTIONS == ("l1", "l2", "crossentropy", "scaledmarginalcrossentropy")
    assert WEIGHT_SCHEMES == ("xavier", "caffexavier", "gaussian", "uniform", "unitball", "constant")
    assert OPTIMIZERS == ("sgd", "momentum", "nesterov", "adagrad", "rmsprop", "adam")
    assert issubclass(NetworkConfigError, ValueError)


def test_dsstne_defaults_when_blocks_are_absent():
    net = {"Layers": [{"Kind": "Input", "N": 10, "DataSet": "x"}, {"Kind": "Output", "N": 3}]}
    cfg = parse_network(net)
    assert cfg.kind == "feedforward"
    assert cfg.name == "network"
    assert cfg.error_function == "crossentropy"
    assert (cfg.one_target, cfg.zero_target, cfg.one_scale, cfg.zero_scale) == (0.9, 0.1, 1.0, 1.0)
    assert (cfg.denoising_p, cfg.sparseness_p, cfg.sparseness_beta) == (0.0, 0.0, 0.0)
    assert cfg.shuffle_indices is True
    assert cfg.hidden == ()
    assert cfg.output.activation == "sigmoid" and cfg.output.dataset is None


def test_name_defaults_to_file_stem_and_hidden_names_are_numbered(tmp_path):
    net = minimal()
    net["Layers"].insert(2, {"Kind": "Hidden", "N": 8})
    cfg = parse_network(write(tmp_path, net, "my_net.json"))
    assert cfg.name == "my_net"
    assert [layer.name for layer in cfg.layers] == ["Input", "Hidden1", "Hidden2", "Output"]


# --------------------------------------------------------------------------------------------
# Case-insensitivity, aliases, the project's Optimizer block.

def test_keys_and_enum_values_are_case_insensitive():
    net = {
        "KIND": "autoencoder", "errorfunction": "smce", "scaledMARGINALcrossentropy": {"ONETARGET": 0.8},
        "layers": [
            {"kind": "INPUT", "n": "AUTO", "dataset": "d", "SPARSE": True, "PDROPOUT": 0.1},
            {"KiNd": "hidden", "N": 4, "activation": "RELU", "weightinit": {"scheme": "GAUSSIAN", "SCALE": 0.01}},
            {"Kind": "output", "N": "Auto", "Activation": "softMAX", "pDropOut": 0.0},
        ],
        "optimizer": {"kind": "ADAM", "alpha": 0.001},
    }
    cfg = parse_network(net)
    assert cfg.kind == "autoencoder"
    assert cfg.error_function == "scaledmarginalcrossentropy"
    assert cfg.one_target == 0.8 and cfg.zero_target == 0.1
    assert cfg.input.p_dropout == 0.1 and cfg.input.sparse is True and cfg.input.n is None
    assert cfg.hidden[0].activation == "relu"
    assert cfg.hidden[0].weight_init == WeightInit("gaussian", 0.01, 0.0)
    assert cfg.output.activation == "softmax" and cfg.output.n is None
    assert cfg.optimizer == Optimizer(kind="adam", alpha=0.001)


def test_dsstne_long_activation_names_are_aliases():
    net = minimal()
    for long_name, short in [("RectifiedLinear", "relu"), ("LeakyRectifiedLinear", "lrelu"),
                             ("ExponentialLinear", "elu"), ("ScaledExponentialLinear", "selu")]:
        net["Layers"][1]["Activation"] = long_name
        assert parse_network(net).hidden[0].activation == short


def test_optimizer_block_all_keys():
    opt = {"Kind": "RMSProp", "Alpha": 0.01, "Mu": 0.9, "Lambda": 0.0, "Beta1": 0.8, "Beta2": 0.99, "Epsilon": 1e-6}
    cfg = parse_network(minimal(Optimizer=opt))
    assert cfg.optimizer == Optimizer("rmsprop", 0.01, 0.9, 0.0, 0.8, 0.99, 1e-6)


def test_same_key_twice_in_different_case_is_an_error():
    msg = error_of(minimal(kind="FeedForward"))
    assert "`kind`" in msg and "'Kind'" in msg and "case-insensitive" in msg


def test_same_key_twice_verbatim_in_a_file_is_an_error(tmp_path):
    text = '{"Kind": "AutoEncoder", "Kind": "FeedForward", "Layers": []}'
    path = write(tmp_path, text)
    msg = error_of(path)
    assert msg.startswith(path) and "`Kind`" in msg and "twice" in msg


# --------------------------------------------------------------------------------------------
# Round trip and resolve().

def test_round_trip_of_sample_and_of_a_rich_config():
    sample = parse_network(SAMPLE)
    assert parse_network(sample.to_json()) == sample
    rich = minimal(Name="rich", ShuffleIndices=False, Denoising={"p": 0.3}, SparsenessPenalty={"p": 0.1, "beta": 1},
                   ErrorFunction="L2", Optimizer={"Kind": "Nesterov", "Mu": 0.95, "Lambda": 0})
    rich["Layers"][1].update(pDropout=0.5, SparsenessPenalty=True, Sparse=True,
                             WeightInit={"Scheme": "UnitBall", "Scale": 2, "Bias": -1.5})
    rich["Layers"][2].update(Name="Scores", Activation="Linear", N=7)
    rich["Layers"][0]["N"] = 7
    cfg = parse_network(rich)
    again = parse_network(json.loads(json.dumps(cfg.to_json())))
    assert again == cfg
    assert again.output.name == "Scores" and again.output.n == 7 and again.error_function == "l2"
    assert again.hidden[0].weight_init == WeightInit("unitball", 2.0, -1.5) and again.hidden[0].sparseness_penalty
    doc = cfg.to_json()
    assert doc["Kind"] == "AutoEncoder" and doc["ErrorFunction"] == "L2"
    assert doc["Layers"][1]["Activation"] == "Relu" and doc["Layers"][1]["pDropout"] == 0.5
    assert doc["Optimizer"]["Kind"] == "Nesterov" and doc["Optimizer"]["Lambda"] == 0.0


def test_resolve_fills_auto():
    cfg = parse_network(SAMPLE).resolve(3706, 3706)
    assert cfg.input.n == 3706 and cfg.output.n == 3706 and cfg.hidden[0].n == 128
    assert parse_network(SAMPLE).input.n is None  # the original is untouched (frozen)


def test_resolve_explicit_n_mismatch_names_layer_and_both_numbers():
    net = minimal(Kind="FeedForward")
    net["Layers"][2]["N"] = 50
    cfg = parse_network(net)
    assert cfg.resolve(100, 50).output.n == 50
    with pytest.raises(NetworkConfigError) as info:
        cfg.resolve(100, 40)
    msg = str(info.value)
    assert "`Layers[2].N`" in msg and "'Output'" in msg and "50" in msg and "40" in msg


def test_resolve_autoencoder_needs_equal_sizes(tmp_path):
    cfg = parse_network(write(tmp_path, minimal()))
    with pytest.raises(NetworkConfigError, match=r"net\.json.*AutoEncoder.*100.*99"):
        cfg.resolve(100, 99)
    with pytest.raises(NetworkConfigError, match="positive integer"):
        cfg.resolve(0, 0)
    assert parse_network(minimal(Kind="FeedForward")).resolve(100, 99).output.n == 99


# --------------------------------------------------------------------------------------------
# Error classes: each message names the file and the JSON path.

def test_unknown_key_suggests_nearest(tmp_path):
    net = minimal()
    net["Layers"][1]["pDrop"] = 0.5
    path = write(tmp_path, net)
    msg = error_of(path)
    assert msg.startswith(path + ":")
    assert "`Layers[1].pDrop`" in msg and "did you mean 'pDropout'" in msg
    assert "Activation" in msg and "WeightInit" in msg  # lists the keys accepted there


def test_unknown_top_level_key_lists_accepted_keys():
    msg = error_of(minimal(ShuffleIndexes=False))
    assert "`ShuffleIndexes`" in msg and "did you mean 'ShuffleIndices'" in msg and "ErrorFunction" in msg


def test_unsupported_dsstne_key_is_a_distinct_error(tmp_path):
    net = minimal()
    net["Layers"][1]["Kernel"] = [3, 3]
    path = write(tmp_path, net)
    msg = error_of(path)
    assert msg.startswith(path)
    assert "`Layers[1].Kernel` = [3, 3] is a DSSTNE setting this engine does not implement; remove it" in msg
    assert "keys accepted in a Hidden layer: Kind, Name, Source, N, Activation, WeightInit" in msg
    for top in ({"WeightData": "w.nc"}, {"LocalResponseNormalization": {"k": 2}}, {"DeltaBoost": {"one": 2.0}}):
        assert "DSSTNE setting this engine does not implement" in error_of(minimal(**top))


@pytest.mark.parametrize("key,value", [
    ("BatchNormalization", True), ("Type", "Convolution"), ("Recurrent", "LSTM"), ("WeightNorm", 1.5),
    ("DeltaNorm", 0.1), ("L1Penalty", 0.01), ("SharedWeights", [{"InputLayer": "Input"}]), ("Skip", "Input"),
])
def test_unsupported_layer_values(key, value):
    net = minimal()
    net["Layers"][1][key] = value
    msg = error_of(net)
    assert f"`Layers[1].{key}`" in msg and "DSSTNE setting this engine does not implement" in msg


def test_no_op_defaults_are_accepted_silently():
    net = minimal(Version="0.8", DeltaBoost={"one": 1.0, "zero": 1})
    net["Layers"][1].update(Type="fullyConnected", BatchNormalization=False, Recurrent="None", WeightNorm=0,
                            DeltaNorm=0.0, L1Penalty=0, SharedWeights=[], Source="Input")
    net["Layers"][2].update(Type="FullyConnected", Source=["Hidden1"])
    assert parse_network(net) == parse_network(minimal())
    assert parse_network(minimal(Version=0.7)) == parse_network(minimal())


@pytest.mark.parametrize("where,key,value,needle", [
    (1, "Activation", "PRelu", "DSSTNE setting"),
    (2, "Activation", "ReluMax", "DSSTNE setting"),
    (1, "Activation", "Sigmod", "did you mean 'Sigmoid'"),
    (1, "WeightInit", {"Scheme": "He"}, "use one of Xavier"),
    (1, "Kind", "Pooling", "DSSTNE setting"),
])
def test_bad_enum_values(where, key, value, needle):
    net = minimal()
    net["Layers"][where][key] = value
    msg = error_of(net)
    path = f"Layers[{where}].{key}" + (".Scheme" if key == "WeightInit" else "")
    assert f"`{path}`" in msg and needle in msg


def test_bad_top_level_enums():
    assert "`Kind`" in (m := error_of(minimal(Kind="Recurrent"))) and "AutoEncoder, FeedForward" in m
    assert "`ErrorFunction`" in (m := error_of(minimal(ErrorFunction="Hinge"))) and "DSSTNE setting" in m
    assert "`Optimizer.Kind`" in (m := error_of(minimal(Optimizer={"Kind": "AdaDelta"}))) and "DSSTNE setting" in m


@pytest.mark.parametrize("mutate,path,expected", [
    (lambda n: n["Layers"][1].update(N="16"), "Layers[1].N", "a positive integer"),
    (lambda n: n["Layers"][1].update(N=16.0), "Layers[1].N", "a positive integer"),
    (lambda n: n["Layers"][1].update(N="auto"), "Layers[1].N", "a positive integer"),
    (lambda n: n["Layers"][1].update(N=0), "Layers[1].N", "a positive integer"),
    (lambda n: n["Layers"][0].update(N=[10, 10]), "Layers[0].N", "DSSTNE setting"),
    (lambda n: n["Layers"][0].update(Sparse="yes"), "Layers[0].Sparse", "expected a boolean"),
    (lambda n: n["Layers"][0].update(Sparse=1), "Layers[0].Sparse", "expected a boolean"),
    (lambda n: n["Layers"][1].update(pDropout="0.5"), "Layers[1].pDropout", "expected a number"),
    (lambda n: n["Layers"][1].update(pDropout=1.0), "Layers[1].pDropout", "[0, 1)"),
    (lambda n: n.update(ShuffleIndices="false"), "ShuffleIndices", "expected a boolean"),
    (lambda n: n.update(Denoising={"p": 1.0}), "Denoising.p", "[0, 1)"),
    (lambda n: n.update(Denoising=0.2), "Denoising", "expected a JSON object"),
    (lambda n: n.update(SparsenessPenalty={"p": 0.5, "beta": -1}), "SparsenessPenalty.beta", ">= 0"),
    (lambda n: n.update(ScaledMarginalCrossEntropy={"oneTarget": 0.2, "zeroTarget": 0.3}),
     "ScaledMarginalCrossEntropy.zeroTarget", "below oneTarget"),
    (lambda n: n.update(ScaledMarginalCrossEntropy={"oneScale": -1}), "ScaledMarginalCrossEntropy.oneScale", ">= 0"),
    (lambda n: n.update(Optimizer={"Alpha": 0}), "Optimizer.Alpha", "> 0"),
    (lambda n: n.update(Version=[1]), "Version", "a number or a string"),
    (lambda n: n.update(Layers={"Kind": "Input"}), "Layers", "expected an array"),
    (lambda n: n["Layers"][1].update(WeightInit={"Bias": "random"}), "Layers[1].WeightInit.Bias", "DSSTNE setting"),
])
def test_bad_types_and_ranges_name_path_and_expectation(tmp_path, mutate, path, expected):
    net = copy.deepcopy(minimal())
    mutate(net)
    file = write(tmp_path, net)
    msg = error_of(file)
    assert msg.startswith(file + ":") and f"`{path}`" in msg and expected in msg


@pytest.mark.parametrize("layers,path,needle", [
    ([{"Kind": "Input", "N": 5, "DataSet": "d"}], "Layers", "at least an Input and an Output"),
    ([{"Kind": "Hidden", "N": 5}, {"Kind": "Output", "N": 5}], "Layers[0].Kind", "exactly one Input first"),
    ([{"Kind": "Input", "N": 5, "DataSet": "d"}, {"Kind": "Input", "N": 5, "DataSet": "d"},
      {"Kind": "Output", "N": 5}], "Layers[1].Kind", "chain"),
    ([{"Kind": "Input", "N": 5, "DataSet": "d"}, {"Kind": "Output", "N": 5}, {"Kind": "Hidden", "N": 5}],
     "Layers[1].Kind", "exactly one Output last"),
    ([{"Kind": "Input", "N": 5}, {"Kind": "Output", "N": 5}], "Layers[0].DataSet", "missing"),
    ([{"Kind": "Input", "N": 5, "DataSet": "d"}, {"N": 5}], "Layers[1].Kind", "missing"),
    ([{"Kind": "Input", "N": 5, "DataSet": "d"}, {"Kind": "Hidden"}, {"Kind": "Output", "N": 5}],
     "Layers[1].N", "missing"),
    ([{"Kind": "Input", "N": 5, "DataSet": "d", "Activation": "Relu"}, {"Kind": "Output", "N": 5}],
     "Layers[0].Activation", "does not apply to an Input layer"),
    ([{"Kind": "Input", "N": 5, "DataSet": "d", "Source": "x"}, {"Kind": "Output", "N": 5}],
     "Layers[0].Source", "does not apply to an Input layer"),
    ([{"Kind": "Input", "N": 5, "DataSet": "d"}, {"Kind": "Hidden", "N": 3, "DataSet": "e"},
      {"Kind": "Output", "N": 5}], "Layers[1].DataSet", "does not apply to a Hidden layer"),
    ([{"Kind": "Input", "N": 5, "DataSet": "d"}, {"Kind": "Hidden", "N": 3}, {"Kind": "Output", "N": 5,
                                                                             "Source": "Input"}],
     "Layers[2].Source", "previous layer 'Hidden1'"),
    ([{"Kind": "Input", "N": 5, "DataSet": "d"}, {"Kind": "Hidden", "N": 3, "Name": "Input"},
      {"Kind": "Output", "N": 5}], "Layers[1].Name", "unique"),
    ([{"Kind": "Input", "N": 5, "DataSet": "d"}, {"Kind": "Output", "N": 6}], "Layers[1].N", "AutoEncoder"),
])
def test_bad_topology(tmp_path, layers, path, needle):
    file = write(tmp_path, {"Kind": "AutoEncoder", "Layers": layers})
    msg = error_of(file)
    assert msg.startswith(file + ":") and f"`{path}`" in msg and needle in msg


def test_missing_layers():
    assert "`Layers`" in error_of({"Kind": "FeedForward"})


def test_softmax_only_on_output(tmp_path):
    net = minimal()
    net["Layers"][1]["Activation"] = "SoftMax"
    file = write(tmp_path, net)
    msg = error_of(file)
    assert msg.startswith(file) and "`Layers[1].Activation`" in msg and "only allowed on the Output layer" in msg
    net["Layers"][1]["Activation"] = "Relu"
    net["Layers"][2]["Activation"] = "SoftMax"
    assert parse_network(net).output.activation == "softmax"


def test_json_syntax_error_names_file_line_and_column(tmp_path):
    text = '{\n  "Kind": "AutoEncoder",\n  "Layers": [\n    {"Kind": "Input",},\n  ]\n}\n'
    path = write(tmp_path, text)
    msg = error_of(path)
    assert msg.startswith(f"{path}:4:")
    assert "line 4" in msg and "column" in msg and "invalid JSON" in msg


def test_missing_file_names_the_path(tmp_path):
    path = str(tmp_path / "nope" / "network.json")
    msg = error_of(path)
    assert path in msg and "no such" in msg
    assert path in error_of(tmp_path / "nope" / "network.json")  # os.PathLike too


def test_messages_without_a_file_start_with_the_path():
    net = minimal()
    net["Layers"][1]["Activation"] = "Softmax"
    assert error_of(net).startswith("`Layers[1].Activation`")


def test_config_is_frozen_and_hashable():
    cfg = parse_network(SAMPLE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.name = "x"  # type: ignore[misc]
    assert hash(cfg) == hash(parse_network(cfg.to_json()))
    assert isinstance(cfg, NetworkConfig)
