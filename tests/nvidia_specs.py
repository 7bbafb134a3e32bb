"""The feature specs of NVIDIA's DLRM test suite (tests/feature_specs/*.yaml and
tests/transcoding/small_csv.yaml in NVIDIA's DeepLearningExamples, PyTorch/Recommendation/DLRM),
written out here as the dicts their YAML files load to, so the tests need no copy of NVIDIA's
repository. Most follow one pattern (NVIDIA's default layout: ``num_<i>``, ``cat_<i>.bin``,
``label``, files under ``<split>/``) and are built by ``_default``; the two that rename
features or move files list their names and paths in full.
"""

from __future__ import annotations

SPLITS = ("test", "train")  # the order of NVIDIA's files (yaml.dump sorts keys)

FL15 = [7912889, 33823, 17139, 7339, 20046, 4, 7105, 1382, 63, 5554114, 582469, 245828, 11, 2209, 10667, 104, 4,
        968, 15, 8165896, 2675940, 7156453, 302516, 12022, 97, 35]
FL15_DTYPES = ["int32", "int32", "int16", "int16", "int16", "int8", "int16", "int16", "int8", "int32", "int32", "int32",
               "int8", "int16", "int16", "int8", "int8", "int16", "int8", "int32", "int32", "int32", "int32", "int16",
               "int8", "int8"]


def _default(num_numerical: int, cardinalities: list[int], dtypes: list[str] | None = None, numerical: list[str] | None = None,
             categorical: list[str] | None = None, label: str = "label", files: dict[str, list[str]] | None = None) -> dict:
    numerical = numerical or [f"num_{i}" for i in range(num_numerical)]
    categorical = categorical or [f"cat_{i}.bin" for i in range(len(cardinalities))]
    dtypes = dtypes or ["int32"] * len(cardinalities)
    features = {name: {"cardinality": card, "dtype": dtype} for name, card, dtype in zip(categorical, cardinalities, dtypes)}
    features.update({name: {"dtype": "float16"} for name in numerical})
    features[label] = {"dtype": "bool"}
    source = {}
    for split in SPLITS:
        paths = (files or {}).get(split) or [f"{split}/numerical.bin", f"{split}/label.bin"] + [f"{split}/{c}" for c in categorical]
        chunks = [{"features": list(numerical), "files": [paths[0]], "type": "split_binary"},
                  {"features": [label], "files": [paths[1]], "type": "split_binary"}]
        chunks += [{"features": [c], "files": [p], "type": "split_binary"} for c, p in zip(categorical, paths[2:])]
        source[split] = chunks
    return {"channel_spec": {"categorical": list(categorical), "label": [label], "numerical": list(numerical)},
            "feature_spec": features, "metadata": {}, "source_spec": source}


_RENAMED_NUMERICAL = ["gadsfgsdfg", "5yrthf", "45ryhtf", "u5j6yrhtfd", "u5rtg3qq", "j65ee5he5", "yhe5h", "4y5e6ru",
                      "5yfwerf", "g53g6y635", "42c524", "bge5v6gve5", "jhw5rf"]
_RENAMED_CATEGORICAL = [
    "65ytfg.bin", "dgtwrg.bin", "hmfgd.bin", "6tyjgh.bin", "67yu.bin", "l6rtd.bin", "ouikjhfg.bin", "65ry.bin",
    "5yhtrfg.bin", "65rty.bin", "34ywesh5rtg.bin", "w4su6js.bin", "45wyhtr.bin", "u65rhty.bin", "tujy.bin", "tyjdh.bin",
    "ujtyesh.bin", "5e7tdyj.bin", "46rjydh.bin", "8kiujynrht.bin", "fsgh.bin", "34eyr.bin", "we5etydj.bin",
    "fsghfsdgh.bin", "hrthshs.bin", "tujyhfg.bin",
]
_MOVED_FILES = {
    "test": [
        "differenttnum.notbin", "different2.foo", "tec341234.b53in", "te2341st/cat_6734567361.b563465345in",
        "test/341234cat_2.bin", "testsadfas/cat_sdfa3.bin", "tessdft/cat_4.bfasdin", "tesdfst/sadfasfcat_5.bin",
        "tessdfat/cat_6sdf.bin", "tedfasdfst/cat_sdf7.bin", "tessadfasfdt/cat_8.bidfasfdn", "tessdfasst/cadfat_9.bin",
        "testertwett/cat_10twertwe.bin", "tesertwertt/cat_1ertw1.bin", "teserqwert/cat_12.bitreten",
        "teetrtwest/cat_13.biywywevgywn", "t5nw5g5w45est/cafw45t_14.bin", "test456f/cat_146w45.bin",
        "test54wehy/cat_1rhyte46.bin", "testrujyt/cat_174w5.bin", "teste45hy/cat_18.be45hyin", "testrtggsertecat_19.bin",
        "testuteyutyut/cat_20.bin", "testyuteyutryt/cat_21.bin", "tesyuirty7iut/cat_22.bin", "tesi6r7it/cat_23.bin",
        "tesutyhergt/cat_24.bin", "testir756irt/cat_25.bin",
    ],
    "train": [
        "train/rtyerytenumerical.bin", "traiherthern/label.bin", "trairtyertyern/cat_0.bin", "trainrtyerty/cat_1.bin",
        "trainyrtyeyjdfg/cat_2.bin", "trainghdfyjert/cat_3.bin", "train/gyutyhcat_4.bin", "train/rethercat_5.bin",
        "traertyeryin/cat_6.bin", "trartyertyin/cat_7.bin", "train/cayretyertyt_8.bin", "train/cat_hfdhfhgd.bin",
        "traintryerdtyin", "trah56jh7w45gein", "train67j56e5g.bin", "tr456tyw4f5in", "tra56egin", "train56hrtdf5.bin",
        "traie56utgfhbbin", "tra56evtdygvbin", "tra566dtyghbi.bin", "trai9uijk.bin", "traiywe5tin", "trairtyhgfbin",
        "trainrfghbin", "trairtgfin", "trairtfgin", "traii76tyn",
    ],
}
_WIDER = ["int64" if i in (0, 3, 7, 9, 15, 20) else "int32" for i in range(26)]

FEATURE_SPECS: dict[str, dict] = {
    "10_num": _default(10, [100000 + i for i in range(26)]),
    "13_num_10_cat": _default(13, [100000 + i for i in range(9)] + [10009], ["int32"] * 9 + ["int16"]),
    "13_num_26_cat": _default(13, [100000 + i for i in range(26)]),
    "13_num_30_cat": _default(13, [100000 + i for i in range(30)]),
    "20_num": _default(20, [100000 + i for i in range(26)]),
    "criteo_f15": _default(13, FL15, FL15_DTYPES),
    "default": _default(13, [100000] * 26),
    "different_feature_names": _default(13, [100000] * 26, numerical=_RENAMED_NUMERICAL,
                                        categorical=_RENAMED_CATEGORICAL, label="qwer"),
    "different_paths": _default(13, [100000] * 26, files=_MOVED_FILES),
    "wider_dtypes": _default(13, [100000] * 26, _WIDER),
}


def _small_csv() -> dict:
    """tests/transcoding/small_csv.yaml: the CSV layout NVIDIA's gen_csv writes and transcode reads."""
    numerical = ["num_0", "num_1", "num_2"]
    categorical = [f"cat_{i}.bin" for i in range(6)]
    cards = [10, 23412, 45000, 100, 50, 127]
    features = {name: {"cardinality": card} for name, card in zip(categorical, cards)}
    features.update({name: {} for name in ["label", *numerical]})

    def chunk(features: list[str], path: str) -> dict:
        return {"features": features, "files": [path], "type": "csv"}

    return {
        "channel_spec": {"categorical": categorical, "label": ["label"], "numerical": numerical},
        "feature_spec": features,
        "metadata": {},
        "source_spec": {
            "test": [chunk(numerical, "test/numerical.bin"), chunk(["label"], "test/label.bin"),
                     chunk(categorical[:2], "test/catpart1.bin"), chunk(categorical[2:], "test/catpart2.bin")],
            "train": [chunk(numerical, "train/numerical.bin"), chunk(["label"], "train/label.bin"),
                      chunk(categorical[:3], "train/catpart0.bin"), chunk(categorical[3:], "train/catpart1.bin")],
        },
    }


SMALL_CSV = _small_csv()
