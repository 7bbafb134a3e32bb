"""The validated network definition: frozen dataclasses, and their DSSTNE JSON form back.

Why apart from the parser (``dlrm.recommender.network``): the model, the loss and checkpoints
use these records and ``to_json``; only a file read needs the parser's validation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


ACTIVATIONS = ("sigmoid", "tanh", "relu", "lrelu", "elu", "selu", "softplus", "linear", "softmax")
ERROR_FUNCTIONS = ("l1", "l2", "crossentropy", "scaledmarginalcrossentropy")
WEIGHT_SCHEMES = ("xavier", "caffexavier", "gaussian", "uniform", "unitball", "constant")
OPTIMIZERS = ("sgd", "momentum", "nesterov", "adagrad", "rmsprop", "adam")

# Spellings written back by to_json (DSSTNE's capitalisation), and accepted aliases.
_ACTIVATION_NAMES = {"sigmoid": "Sigmoid", "tanh": "Tanh", "relu": "Relu", "lrelu": "LRelu", "elu": "Elu",
                     "selu": "Selu", "softplus": "SoftPlus", "linear": "Linear", "softmax": "SoftMax"}
_ACTIVATION_ALIASES = {"rectifiedlinear": "relu", "leakyrectifiedlinear": "lrelu", "exponentiallinear": "elu",
                       "scaledexponentiallinear": "selu"}
_ACTIVATION_UNSUPPORTED = ("PRelu", "ParametricRectifiedLinear", "SoftSign", "LinearMax", "MaxOut", "ReluMax")
_ERROR_NAMES = {"l1": "L1", "l2": "L2", "crossentropy": "CrossEntropy",
                "scaledmarginalcrossentropy": "ScaledMarginalCrossEntropy"}
_ERROR_ALIASES = {"smce": "scaledmarginalcrossentropy"}
_ERROR_UNSUPPORTED = ("DataScaledMarginalCrossEntropy", "Hinge", "L2Hinge")
_SCHEME_NAMES = {"xavier": "Xavier", "caffexavier": "CaffeXavier", "gaussian": "Gaussian", "uniform": "Uniform",
                 "unitball": "UnitBall", "constant": "Constant"}
_OPTIMIZER_NAMES = {"sgd": "SGD", "momentum": "Momentum", "nesterov": "Nesterov", "adagrad": "AdaGrad",
                    "rmsprop": "RMSProp", "adam": "Adam"}
_OPTIMIZER_UNSUPPORTED = ("AdaDelta",)
_NETWORK_KINDS = {"autoencoder": "AutoEncoder", "feedforward": "FeedForward"}
_LAYER_KINDS = {"input": "Input", "hidden": "Hidden", "output": "Output"}
_LAYER_KINDS_UNSUPPORTED = ("Pooling", "Target")
_NORMALIZATION_NAMES = {"none": "None", "l2": "L2"}


class NetworkConfigError(ValueError):
    """A network definition this engine cannot train as written; the message says where and how to fix it."""


@dataclass(frozen=True)
class WeightInit:
    """How a layer's incoming weights and bias start (DSSTNE's ``WeightInit`` block)."""

    scheme: str = "xavier"
    scale: float = 1.0
    bias: float = 0.0


@dataclass(frozen=True)
class Layer:
    """One layer of the chain. ``n`` None means "auto": the dataset's feature count, set by resolve()."""

    kind: str
    name: str
    n: int | None
    sparse: bool = False
    dataset: str | None = None
    activation: str = "sigmoid"
    p_dropout: float = 0.0
    weight_init: WeightInit = WeightInit()
    sparseness_penalty: bool = False


@dataclass(frozen=True)
class Optimizer:
    """This project's ``Optimizer`` block; DSSTNE set these on its train command line.

    ``mu`` is the momentum of momentum/nesterov and the mean-square decay of rmsprop (as in
    DSSTNE); sgd, adagrad and adam ignore it.
    """

    kind: str = "sgd"
    alpha: float = 0.025
    mu: float = 0.5
    lambda_: float = 0.0001
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8


@dataclass(frozen=True)
class Variational:
    """This project's ``Variational`` block (Mult-VAE): hidden layer ``layer`` is the latent.

    Why a block and not a layer kind: DSSTNE's layer JSON has no stochastic layer, and the rest
    of the chain stays DSSTNE's. The KL weight at step s is ``beta * min(1, s / anneal_steps)``
    (``beta`` throughout when ``anneal_steps`` is 0): Liang et al.'s annealing, whose
    ``anneal_cap`` 0.2 and ``total_anneal_steps`` 200000 are ``beta`` 0.2, ``anneal_steps`` 40000.
    """

    layer: str
    beta: float = 1.0
    anneal_steps: int = 0


@dataclass(frozen=True)
class NetworkConfig:
    """A whole network definition, validated; ``source`` only feeds messages and is left out of ==."""

    name: str
    kind: str
    layers: tuple[Layer, ...]
    error_function: str = "crossentropy"
    one_target: float = 0.9
    zero_target: float = 0.1
    one_scale: float = 1.0
    zero_scale: float = 1.0
    denoising_p: float = 0.0
    sparseness_p: float = 0.0
    sparseness_beta: float = 0.0
    shuffle_indices: bool = True
    optimizer: Optimizer = Optimizer()
    input_normalization: str = "none"
    variational: Variational | None = None
    source: str | None = field(default=None, compare=False)

    @property
    def input(self) -> Layer:
        return self.layers[0]

    @property
    def output(self) -> Layer:
        return self.layers[-1]

    @property
    def hidden(self) -> tuple[Layer, ...]:
        return self.layers[1:-1]

    def resolve(self, n_input: int, n_output: int) -> NetworkConfig:
        """Fills N "auto" from the datasets' feature counts, so the model never guesses a width.

        An explicit N that disagrees with its dataset is an error naming the layer and both
        numbers; an autoencoder reconstructs its input, so it needs ``n_input == n_output``.
        """
        last = len(self.layers) - 1
        for what, value in (("n_input", n_input), ("n_output", n_output)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise NetworkConfigError(f"{_where(self.source)}resolve(): {what} must be a positive integer "
                                         f"(the dataset's feature count), got {value!r}")
        resolved = []
        for index, layer, n in ((0, self.input, n_input), (last, self.output, n_output)):
            if layer.n is not None and layer.n != n:
                raise NetworkConfigError(
                    f"{_where(self.source)}`Layers[{index}].N`: layer {layer.name!r} says N = {layer.n} but its "
                    f"dataset {layer.dataset or '(unnamed)'!r} has {n} features; set \"N\": \"auto\" or {n}")
            resolved.append(dataclasses.replace(layer, n=n))
        if self.kind == "autoencoder" and n_input != n_output:
            raise NetworkConfigError(
                f"{_where(self.source)}`Kind`: an AutoEncoder reconstructs its input, but the input has {n_input} "
                f"features and the output {n_output}; give both layers the same dataset, or use \"Kind\": "
                f"\"FeedForward\"")
        return dataclasses.replace(self, layers=(resolved[0], *self.hidden, resolved[1]))

    def to_json(self) -> dict:
        """DSSTNE-keyed dict (DSSTNE's capitalisation); ``parse_network`` turns it back into an equal config."""
        layers = []
        for index, layer in enumerate(self.layers):
            entry: dict[str, Any] = {"Name": layer.name, "Kind": _LAYER_KINDS[layer.kind]}
            if layer.kind != "input" and index > 0:
                entry["Source"] = self.layers[index - 1].name
            if layer.dataset is not None:
                entry["DataSet"] = layer.dataset
            entry["N"] = "auto" if layer.n is None else layer.n
            if layer.kind != "input":
                entry["Activation"] = _ACTIVATION_NAMES[layer.activation]
                entry["WeightInit"] = {"Scheme": _SCHEME_NAMES[layer.weight_init.scheme],
                                       "Scale": layer.weight_init.scale, "Bias": layer.weight_init.bias}
                entry["SparsenessPenalty"] = layer.sparseness_penalty
            entry["Sparse"] = layer.sparse
            entry["pDropout"] = layer.p_dropout
            layers.append(entry)
        opt = self.optimizer
        extra: dict[str, Any] = {}
        if self.variational is not None:
            v = self.variational
            extra["Variational"] = {"Layer": v.layer, "Beta": v.beta, "AnnealSteps": v.anneal_steps}
        return {
            "Name": self.name,
            "Kind": _NETWORK_KINDS[self.kind],
            "ShuffleIndices": self.shuffle_indices,
            "SparsenessPenalty": {"p": self.sparseness_p, "beta": self.sparseness_beta},
            "Denoising": {"p": self.denoising_p},
            "ScaledMarginalCrossEntropy": {"oneTarget": self.one_target, "zeroTarget": self.zero_target,
                                           "oneScale": self.one_scale, "zeroScale": self.zero_scale},
            "Layers": layers,
            "ErrorFunction": _ERROR_NAMES[self.error_function],
            "Optimizer": {"Kind": _OPTIMIZER_NAMES[opt.kind], "Alpha": opt.alpha, "Mu": opt.mu,
                          "Lambda": opt.lambda_, "Beta1": opt.beta1, "Beta2": opt.beta2, "Epsilon": opt.epsilon},
            "InputNormalization": _NORMALIZATION_NAMES[self.input_normalization],
            **extra,
        }


def _where(source: str | None) -> str:
    """The message prefix naming the file a config came from (nothing for a dict)."""
    return f"{source}: " if source else ""
