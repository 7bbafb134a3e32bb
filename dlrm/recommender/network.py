"""DSSTNE's JSON network definition, parsed and validated into the dataclasses of network_config.

Why: people moving from Amazon DSSTNE bring the network files they already have (its "Layer
Definition Language", LDL.txt rev 0.8). This module reads those files as they are, so a DSSTNE
autoencoder config trains here unchanged, and turns everything this engine would silently get
wrong into an error that names the file, the JSON path of the bad key and the fix.

What is accepted (keys case-insensitive, as DSSTNE's files mix ``pDropout``, ``oneTarget``,
``Sparse``; the same key twice, in any case, is an error; enum values case-insensitive too):

- top level: ``Version`` (number or string, ignored), ``Name``, ``Kind`` (``AutoEncoder`` or
  ``FeedForward``, DSSTNE's default), ``ShuffleIndices``, ``SparsenessPenalty {p, beta}``,
  ``Denoising {p}``, ``ScaledMarginalCrossEntropy {oneTarget, zeroTarget, oneScale, zeroScale}``,
  ``Layers``, ``ErrorFunction`` (``L1``, ``L2``, ``CrossEntropy``, ``ScaledMarginalCrossEntropy``
  or its alias ``SMCE``); this project's ``InputNormalization`` and ``Variational`` (below).
- ``Layers``: a chain of one ``Input`` (``Name, DataSet, N, Sparse, pDropout``), any number of
  ``Hidden`` and one ``Output`` (``Name, Source, Type, N, Activation, WeightInit {Scheme, Scale,
  Bias}, pDropout, Sparse, SparsenessPenalty``; an Output also takes ``DataSet``). ``N`` is a
  positive integer, or ``"auto"`` on Input/Output (filled in by :meth:`NetworkConfig.resolve`).
  Activations: Sigmoid, Tanh, Relu, LRelu, Elu, Selu, SoftPlus, Linear, SoftMax (Output only);
  DSSTNE's long names RectifiedLinear, LeakyRectifiedLinear, ExponentialLinear and
  ScaledExponentialLinear are read as the short ones.

What differs from DSSTNE:

- This project adds an ``Optimizer`` block (``Kind`` in SGD, Momentum, Nesterov, AdaGrad,
  RMSProp, Adam; ``Alpha`` learning rate, ``Mu``, ``Lambda`` L2 weight decay, ``Beta1``,
  ``Beta2``, ``Epsilon``). DSSTNE took these on its ``train`` command line, which a config file
  cannot carry. ``Mu`` is the momentum of Momentum/Nesterov and, as in DSSTNE's RMSProp kernel,
  the decay rate of RMSProp's mean square; SGD, AdaGrad and Adam ignore it.
- This project adds two keys for Liang et al.'s Mult-DAE and Mult-VAE ("Variational
  Autoencoders for Collaborative Filtering", 2018), which DSSTNE has no words for:
  ``InputNormalization`` (``None`` or ``L2``: each user's input row divided by its L2 norm
  before the first layer) and ``Variational {Layer, Beta, AnnealSteps}`` (the hidden layer
  ``Layer``, by default the narrowest, emits a mean and a log-variance of its width; a Gaussian
  sample of them goes on during training, the mean at inference; ``Beta`` times the KL
  divergence to N(0, I) joins the loss, the weight rising linearly from 0 to ``Beta`` over the
  first ``AnnealSteps`` steps, 0 meaning ``Beta`` from the start).
- Only fully connected chains. DSSTNE settings this engine does not implement (WeightData,
  LocalResponseNormalization, DeltaBoost, convolution and pooling, Kernel, KernelStride, Target
  layers, recurrent layers, SharedWeights, BatchNormalization, WeightNorm, DeltaNorm, L1Penalty,
  Skip, Dimensions, multi-dimensional N, activations such as PRelu, SoftSign, LinearMax, MaxOut,
  ReluMax, a random Bias) are errors of their own kind rather than being ignored, except where
  the value given is the no-op default (``"Type": "FullyConnected"``, ``"BatchNormalization":
  false``, ``"Recurrent": "None"``, ``"WeightNorm": 0``, ``"SharedWeights": []``, ``"DeltaBoost":
  {"one": 1, "zero": 1}``...), which are accepted silently.
- ``Source`` is accepted only when it names the previous layer; on an Input layer it is not
  accepted (an Input reads its ``DataSet``).
- Files are strict JSON (no comments, no trailing commas); syntax errors name line and column.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from dlrm.recommender.network_config import (
    _ACTIVATION_ALIASES, _ACTIVATION_NAMES, _ACTIVATION_UNSUPPORTED, _ERROR_ALIASES, _ERROR_NAMES,
    _ERROR_UNSUPPORTED, _LAYER_KINDS, _LAYER_KINDS_UNSUPPORTED, _NETWORK_KINDS, _NORMALIZATION_NAMES,
    _OPTIMIZER_NAMES, _OPTIMIZER_UNSUPPORTED, _SCHEME_NAMES, ACTIVATIONS, ERROR_FUNCTIONS, OPTIMIZERS,
    WEIGHT_SCHEMES, Layer, NetworkConfig, NetworkConfigError, Optimizer, Variational, WeightInit)
from dlrm.recommender.network_values import (
    _bool, _Ctx, _enum, _float, _is_number, _join, _load, _n, _str, _type_name)

__all__ = [
    "ACTIVATIONS",
    "ERROR_FUNCTIONS",
    "OPTIMIZERS",
    "WEIGHT_SCHEMES",
    "Layer",
    "NetworkConfig",
    "NetworkConfigError",
    "Optimizer",
    "Variational",
    "WeightInit",
    "parse_network",
]


# Parsing DSSTNE's keys: pure functions over a _Ctx that only carries the file name.

# A DSSTNE setting this engine does not implement: canonical spelling, and a test for the
# no-op value that is accepted silently (None: no value is a no-op).
_Unsupported = Mapping[str, tuple[str, Callable[[Any], bool] | None, str]]


def _zero(v: Any) -> bool:
    return _is_number(v) and v == 0


def _empty(v: Any) -> bool:
    return v == [] or v == {}


def _noop_delta_boost(v: Any) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str) and k.lower() in ("one", "zero") and _is_number(x) and x == 1 for k, x in v.items())


_TOP_UNSUPPORTED: _Unsupported = {
    "weightdata": ("WeightData", None, ""),
    "localresponsenormalization": ("LocalResponseNormalization", None, ""),
    "deltaboost": ("DeltaBoost", _noop_delta_boost, '{"one": 1.0, "zero": 1.0}'),
}
_LAYER_UNSUPPORTED: _Unsupported = {
    "type": ("Type", lambda v: isinstance(v, str) and v.lower() == "fullyconnected", '"FullyConnected"'),
    "batchnormalization": ("BatchNormalization", lambda v: v is False, "false"),
    "recurrent": ("Recurrent", lambda v: isinstance(v, str) and v.lower() == "none", '"None"'),
    "weightnorm": ("WeightNorm", _zero, "0"),
    "deltanorm": ("DeltaNorm", _zero, "0"),
    "l1penalty": ("L1Penalty", _zero, "0"),
    "sharedweights": ("SharedWeights", _empty, "[]"),
    "kernel": ("Kernel", None, ""),
    "kernelstride": ("KernelStride", None, ""),
    "skip": ("Skip", None, ""),
    "dimensions": ("Dimensions", None, ""),
    "function": ("Function", None, ""),
    "target": ("Target", None, ""),
}
_NO_UNSUPPORTED: _Unsupported = {}

_TOP_KEYS = ("Version", "Name", "Kind", "ShuffleIndices", "SparsenessPenalty", "Denoising",
             "ScaledMarginalCrossEntropy", "Layers", "ErrorFunction", "Optimizer", "InputNormalization",
             "Variational")
_INPUT_KEYS = ("Kind", "Name", "DataSet", "N", "Sparse", "pDropout")
_HIDDEN_KEYS = ("Kind", "Name", "Source", "N", "Activation", "WeightInit", "pDropout", "Sparse", "SparsenessPenalty")
_OUTPUT_KEYS = _HIDDEN_KEYS + ("DataSet",)
_ALL_LAYER_KEYS = {k.lower(): k for k in _OUTPUT_KEYS + _INPUT_KEYS}


def _take(ctx: _Ctx, obj: Any, path: str, accepted: tuple[str, ...], where: str,
          unsupported: _Unsupported = _NO_UNSUPPORTED, other_keys: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Checks an object's keys and returns {canonical key: value} for the accepted ones.

    Case-insensitive; a key given twice (any case) is an error; a DSSTNE setting this engine
    lacks is an error unless its value is the no-op default; a key that belongs to another layer
    kind says so; anything else is an unknown key, with the nearest accepted key suggested.
    """
    if not isinstance(obj, dict):
        raise ctx.fail(path or "(top level)", f"expected a JSON object, got {_type_name(obj)}")
    prefix = f"{path}." if path else ""
    for dup in getattr(obj, "duplicates", ()):
        raise ctx.fail(prefix + dup, "this key is given twice; keep one")
    canonical = {k.lower(): k for k in accepted}
    listing = f"(keys accepted in {where}: {_join(accepted)})"
    seen: dict[str, str] = {}
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if not isinstance(key, str):
            raise ctx.fail(f"{prefix}{key!r}", "keys must be strings")
        low = key.lower()
        if low in seen:
            raise ctx.fail(prefix + key, f"the same key as {seen[low]!r} (keys are case-insensitive); keep one")
        seen[low] = key
        if low in canonical:
            out[canonical[low]] = value
            continue
        if low in unsupported:
            _, is_noop, noop_text = unsupported[low]
            if is_noop is not None and is_noop(value):
                continue
            fix = f"remove it or set it to {noop_text}" if is_noop is not None else "remove it"
            raise ctx.unsupported(prefix + key, value, f"{fix} {listing}")
        if other_keys is not None and low in other_keys:
            raise ctx.fail(prefix + key, f"{other_keys[low]} does not apply to {where}; remove it {listing}")
        near = difflib.get_close_matches(low, list(canonical) + list(unsupported), n=1, cutoff=0.6)
        hint = ""
        if near:
            hint = f"did you mean {canonical.get(near[0]) or unsupported[near[0]][0]!r}? "
        raise ctx.fail(prefix + key, f"unknown key; {hint}{listing}")
    return out


def _parse_weight_init(ctx: _Ctx, v: Any, path: str) -> WeightInit:
    keys = _take(ctx, v, path, ("Scheme", "Scale", "Bias"), "WeightInit")
    scheme = _enum(ctx, keys["Scheme"], f"{path}.Scheme", _SCHEME_NAMES) if "Scheme" in keys else "xavier"
    scale = _float(ctx, keys["Scale"], f"{path}.Scale") if "Scale" in keys else 1.0
    bias = 0.0
    if "Bias" in keys:
        if isinstance(keys["Bias"], str):
            raise ctx.unsupported(f"{path}.Bias", keys["Bias"], "give the bias as a number")
        bias = _float(ctx, keys["Bias"], f"{path}.Bias")
    return WeightInit(scheme=scheme, scale=scale, bias=bias)


def _parse_layer(ctx: _Ctx, raw: Any, index: int, count: int, previous: Layer | None, hidden_index: int) -> Layer:
    path = f"Layers[{index}]"
    if not isinstance(raw, dict):
        raise ctx.fail(path, f"expected a layer object, got {_type_name(raw)}")
    kind_keys = [k for k in raw if isinstance(k, str) and k.lower() == "kind"]
    if not kind_keys:
        raise ctx.fail(f"{path}.Kind", 'missing; every layer needs "Kind": "Input", "Hidden" or "Output"')
    kind_path = f"{path}.{kind_keys[0]}"
    kind = _enum(ctx, raw[kind_keys[0]], kind_path, _LAYER_KINDS, unsupported=_LAYER_KINDS_UNSUPPORTED)
    expected = "input" if index == 0 else "output" if index == count - 1 else "hidden"
    if kind != expected:
        position = {"input": "the first layer", "output": "the last layer", "hidden": "between them"}
        raise ctx.fail(kind_path, f"a {_LAYER_KINDS[kind]} layer at position {index}; layers form a chain: exactly one "
                                  f"Input first, Hidden layers in between, exactly one Output last "
                                  f"(here {position[expected]}: {_LAYER_KINDS[expected]})")
    accepted = {"input": _INPUT_KEYS, "hidden": _HIDDEN_KEYS, "output": _OUTPUT_KEYS}[kind]
    where = {"input": "an Input layer", "hidden": "a Hidden layer", "output": "an Output layer"}[kind]
    keys = _take(ctx, raw, path, accepted, where, _LAYER_UNSUPPORTED, other_keys=_ALL_LAYER_KEYS)

    default_name = {"input": "Input", "hidden": f"Hidden{hidden_index}", "output": "Output"}[kind]
    name = _str(ctx, keys["Name"], f"{path}.Name") if "Name" in keys else default_name
    if "Source" in keys:
        src = keys["Source"]
        if isinstance(src, list) and len(src) == 1:
            src = src[0]
        assert previous is not None  # the Input layer does not accept Source
        if src != previous.name:
            raise ctx.fail(f"{path}.Source", f"{json.dumps(keys['Source'])}: this engine builds a chain, so Source "
                                             f"must name the previous layer {previous.name!r}; use "
                                             f"\"Source\": {json.dumps(previous.name)} or leave it out")
    n_raw = keys.get("N")
    if n_raw is None:
        hint = 'a positive integer or "auto"' if kind != "hidden" else "a positive integer"
        raise ctx.fail(f"{path}.N", f"missing; give the layer's width as {hint}")
    n = _n(ctx, n_raw, f"{path}.N", allow_auto=kind != "hidden")
    dataset = _str(ctx, keys["DataSet"], f"{path}.DataSet") if "DataSet" in keys else None
    if kind == "input" and dataset is None:
        raise ctx.fail(f"{path}.DataSet", 'missing; an Input layer reads a dataset: add "DataSet": "<name>"')
    activation = "sigmoid"
    if "Activation" in keys:
        activation = _enum(ctx, keys["Activation"], f"{path}.Activation", _ACTIVATION_NAMES, _ACTIVATION_ALIASES,
                           _ACTIVATION_UNSUPPORTED)
        if activation == "softmax" and kind != "output":
            raise ctx.fail(f"{path}.Activation", "SoftMax is only allowed on the Output layer; use Sigmoid, Tanh, "
                                                 "Relu, LRelu, Elu, Selu, SoftPlus or Linear here")
    p_dropout = (_float(ctx, keys["pDropout"], f"{path}.pDropout", "[0,1)")
                 if "pDropout" in keys else 0.0)
    return Layer(
        kind=kind, name=name, n=n,
        sparse=_bool(ctx, keys["Sparse"], f"{path}.Sparse") if "Sparse" in keys else False,
        dataset=dataset, activation=activation, p_dropout=p_dropout,
        weight_init=(_parse_weight_init(ctx, keys["WeightInit"], f"{path}.WeightInit")
                     if "WeightInit" in keys else WeightInit()),
        sparseness_penalty=(_bool(ctx, keys["SparsenessPenalty"], f"{path}.SparsenessPenalty")
                            if "SparsenessPenalty" in keys else False),
    )


def _parse_optimizer(ctx: _Ctx, v: Any) -> Optimizer:
    keys = _take(ctx, v, "Optimizer", ("Kind", "Alpha", "Mu", "Lambda", "Beta1", "Beta2", "Epsilon"),
                 "Optimizer (this project's block)")
    d = Optimizer()
    return Optimizer(
        kind=(_enum(ctx, keys["Kind"], "Optimizer.Kind", _OPTIMIZER_NAMES, unsupported=_OPTIMIZER_UNSUPPORTED)
              if "Kind" in keys else d.kind),
        alpha=_float(ctx, keys["Alpha"], "Optimizer.Alpha", ">0") if "Alpha" in keys else d.alpha,
        mu=_float(ctx, keys["Mu"], "Optimizer.Mu", "[0,1)") if "Mu" in keys else d.mu,
        lambda_=_float(ctx, keys["Lambda"], "Optimizer.Lambda", ">=0") if "Lambda" in keys else d.lambda_,
        beta1=_float(ctx, keys["Beta1"], "Optimizer.Beta1", "[0,1)") if "Beta1" in keys else d.beta1,
        beta2=_float(ctx, keys["Beta2"], "Optimizer.Beta2", "[0,1)") if "Beta2" in keys else d.beta2,
        epsilon=(_float(ctx, keys["Epsilon"], "Optimizer.Epsilon", ">0")
                 if "Epsilon" in keys else d.epsilon),
    )


def _parse_variational(ctx: _Ctx, v: Any, layers: list[Layer]) -> Variational:
    keys = _take(ctx, v, "Variational", ("Layer", "Beta", "AnnealSteps"), "Variational (this project's block)")
    hidden = layers[1:-1]
    if not hidden:
        raise ctx.fail("Variational", "needs a Hidden layer to be the latent; add one between Input and Output")
    if "Layer" in keys:
        name = _str(ctx, keys["Layer"], "Variational.Layer")
        if name not in [layer.name for layer in hidden]:
            raise ctx.fail("Variational.Layer", f"{name!r} is not a Hidden layer; use one of "
                                                f"{_join(tuple(layer.name for layer in hidden))}")
    else:
        name = min(hidden, key=lambda layer: layer.n).name  # the bottleneck; the first of equals
    index = [layer.name for layer in layers].index(name)
    if layers[index].activation != "linear":
        raise ctx.fail(f"Layers[{index}].Activation",
                       f"the Variational layer {name!r} emits a mean and a log-variance, which are linear; set "
                       f"\"Activation\": \"Linear\"")
    steps = keys.get("AnnealSteps", 0)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ctx.fail("Variational.AnnealSteps", f"expected an integer >= 0, got {_type_name(steps)}")
    beta = _float(ctx, keys["Beta"], "Variational.Beta", ">=0") if "Beta" in keys else 1.0
    return Variational(layer=name, beta=beta, anneal_steps=steps)


def _network_name(ctx: _Ctx, top: dict) -> str:
    """``Name``, else the file's name without its extension, else "network"."""
    if "Name" in top:
        return _str(ctx, top["Name"], "Name")
    if ctx.source:
        return os.path.splitext(os.path.basename(ctx.source))[0]
    return "network"


def _parse_penalties(ctx: _Ctx, top: dict) -> tuple[float, float, float]:
    """(SparsenessPenalty.p, SparsenessPenalty.beta, Denoising.p), 0 where not given."""
    sparseness_p = sparseness_beta = 0.0
    if "SparsenessPenalty" in top:
        sp = _take(ctx, top["SparsenessPenalty"], "SparsenessPenalty", ("p", "beta"), "SparsenessPenalty")
        if "p" in sp:
            sparseness_p = _float(ctx, sp["p"], "SparsenessPenalty.p", "[0,1)")
        if "beta" in sp:
            sparseness_beta = _float(ctx, sp["beta"], "SparsenessPenalty.beta", ">=0")
    denoising_p = 0.0
    if "Denoising" in top:
        dn = _take(ctx, top["Denoising"], "Denoising", ("p",), "Denoising")
        if "p" in dn:
            denoising_p = _float(ctx, dn["p"], "Denoising.p", "[0,1)")
    return sparseness_p, sparseness_beta, denoising_p


def _parse_smce(ctx: _Ctx, top: dict) -> dict[str, float]:
    """The ScaledMarginalCrossEntropy targets and scales, DSSTNE's defaults where not given."""
    smce = {"oneTarget": 0.9, "zeroTarget": 0.1, "oneScale": 1.0, "zeroScale": 1.0}
    if "ScaledMarginalCrossEntropy" in top:
        block = _take(ctx, top["ScaledMarginalCrossEntropy"], "ScaledMarginalCrossEntropy", tuple(smce),
                      "ScaledMarginalCrossEntropy")
        for key, value in block.items():
            p = f"ScaledMarginalCrossEntropy.{key}"
            smce[key] = _float(ctx, value, p, "[0,1]" if key.endswith("Target") else ">=0")
        if not smce["zeroTarget"] < smce["oneTarget"]:
            raise ctx.fail("ScaledMarginalCrossEntropy.zeroTarget",
                           f"zeroTarget {smce['zeroTarget']:g} must be below oneTarget {smce['oneTarget']:g}; "
                           f"use 0 <= zeroTarget < oneTarget <= 1")
    return smce


def _parse_layers(ctx: _Ctx, top: dict, kind: str) -> list[Layer]:
    """``Layers``: each checked against the one before it, names unique, and an autoencoder's
    output as wide as its input."""
    raw_layers = top.get("Layers")
    if raw_layers is None:
        raise ctx.fail("Layers", "missing; give an array of layers: one Input, any Hidden, one Output")
    if not isinstance(raw_layers, list):
        raise ctx.fail("Layers", f"expected an array of layer objects, got {_type_name(raw_layers)}")
    if len(raw_layers) < 2:
        raise ctx.fail("Layers", f"{len(raw_layers)} layer(s); a network needs at least an Input and an Output layer")
    layers: list[Layer] = []
    for index, raw_layer in enumerate(raw_layers):
        layers.append(_parse_layer(ctx, raw_layer, index, len(raw_layers), layers[-1] if layers else None,
                                   hidden_index=index))
    seen: dict[str, int] = {}
    for index, layer in enumerate(layers):
        if layer.name in seen:
            raise ctx.fail(f"Layers[{index}].Name", f"{layer.name!r} is also the name of Layers[{seen[layer.name]}]; "
                                                    f"layer names must be unique")
        seen[layer.name] = index
    if kind == "autoencoder" and None not in (layers[0].n, layers[-1].n) and layers[0].n != layers[-1].n:
        raise ctx.fail(f"Layers[{len(layers) - 1}].N",
                       f"an AutoEncoder reconstructs its input, but the input has N = {layers[0].n} and the output "
                       f"N = {layers[-1].n}; make them equal (or \"auto\")")
    return layers


def parse_network(source: str | os.PathLike | dict) -> NetworkConfig:
    """Reads a DSSTNE network definition (a JSON file's path, or an already-loaded dict) and validates it."""
    if isinstance(source, dict):
        raw, ctx = source, _Ctx(None)
    else:
        raw, path = _load(source)
        ctx = _Ctx(path)
    top = _take(ctx, raw, "", _TOP_KEYS, "the top level", _TOP_UNSUPPORTED)

    if "Version" in top and not (_is_number(top["Version"]) or isinstance(top["Version"], str)):
        raise ctx.fail("Version", f"expected a number or a string, got {_type_name(top['Version'])}")
    name = _network_name(ctx, top)
    kind = _enum(ctx, top["Kind"], "Kind", _NETWORK_KINDS) if "Kind" in top else "feedforward"
    shuffle = _bool(ctx, top["ShuffleIndices"], "ShuffleIndices") if "ShuffleIndices" in top else True
    sparseness_p, sparseness_beta, denoising_p = _parse_penalties(ctx, top)
    smce = _parse_smce(ctx, top)
    error = (_enum(ctx, top["ErrorFunction"], "ErrorFunction", _ERROR_NAMES, _ERROR_ALIASES, _ERROR_UNSUPPORTED)
             if "ErrorFunction" in top else "crossentropy")
    layers = _parse_layers(ctx, top, kind)
    normalization = (_enum(ctx, top["InputNormalization"], "InputNormalization", _NORMALIZATION_NAMES)
                     if "InputNormalization" in top else "none")
    variational = _parse_variational(ctx, top["Variational"], layers) if "Variational" in top else None

    return NetworkConfig(
        name=name, kind=kind, layers=tuple(layers), error_function=error,
        one_target=smce["oneTarget"], zero_target=smce["zeroTarget"],
        one_scale=smce["oneScale"], zero_scale=smce["zeroScale"],
        denoising_p=denoising_p, sparseness_p=sparseness_p, sparseness_beta=sparseness_beta,
        shuffle_indices=shuffle,
        optimizer=_parse_optimizer(ctx, top["Optimizer"]) if "Optimizer" in top else Optimizer(),
        input_normalization=normalization, variational=variational,
        source=ctx.source,
    )
