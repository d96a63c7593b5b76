"""AdaFlashConfig: validation messages, default target layers, save/load round trip."""

import pytest

from adaflash_hf import AdaFlashConfig, default_target_layer_ids

# A valid tiny config; each validation case overrides one field.
BASE = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_target_layers=4,
    mask_token_id=127,
    block_size=8,
)

# (case id, overrides, fragments the ValueError message must contain)
INVALID_CASES = [
    ("layer_id_too_high", dict(target_layer_ids=[1, 4]), ["target_layer_ids", "[4]", "num_target_layers=4"]),
    ("layer_id_negative", dict(target_layer_ids=[-1]), ["target_layer_ids", "[-1]"]),
    ("layer_ids_empty", dict(target_layer_ids=[]), ["target_layer_ids", "empty"]),
    ("block_size_1", dict(block_size=1), ["block_size", ">= 2", "got 1"]),
    ("block_size_0", dict(block_size=0), ["block_size", "got 0"]),
    ("mask_none", dict(mask_token_id=None), ["mask_token_id", "missing"]),
    ("mask_equals_vocab", dict(mask_token_id=128), ["mask_token_id 128", "outside the vocabulary", "128"]),
    ("mask_negative", dict(mask_token_id=-1), ["mask_token_id -1", "outside the vocabulary"]),
    ("heads_not_divisible", dict(num_attention_heads=4, num_key_value_heads=3), ["num_attention_heads (4)", "num_key_value_heads", "(3)"]),
    ("length_min_zero", dict(length_min=0), ["length_min", "got 0"]),
    ("length_min_above_block", dict(length_min=9), ["length_min", "block_size=8", "got 9"]),
    ("rate_zero", dict(length_rate=0.0), ["length_rate", "> 0"]),
    ("rate_negative", dict(length_rate=-0.5), ["length_rate", "-0.5"]),
    ("length_head_dim_zero", dict(length_head_dim=0), ["length_head_dim", "got 0"]),
]


@pytest.mark.parametrize("overrides, fragments", [c[1:] for c in INVALID_CASES], ids=[c[0] for c in INVALID_CASES])
def test_invalid_config_names_the_problem(overrides, fragments):
    with pytest.raises(ValueError) as err:
        AdaFlashConfig(**{**BASE, **overrides})
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_valid_base_config_builds():
    config = AdaFlashConfig(**BASE)
    assert config.model_type == "adaflash"
    assert config.target_layer_ids == default_target_layer_ids(4, 2)
    assert config.layer_types == ["full_attention"] * 2
    # Boundary values that must be accepted.
    AdaFlashConfig(**{**BASE, "block_size": 2, "length_min": 2, "mask_token_id": 0, "target_layer_ids": [0, 3]})


# (num_target_layers L, num_draft_layers n, expected ids): round(1 + i*(L-4)/(n-1)), one layer -> [L//2].
LAYER_ID_CASES = [
    (36, 5, [1, 9, 17, 25, 33]),  # SPEC example (Qwen3-8B drafter)
    (32, 5, [1, 8, 15, 22, 29]),  # Llama-3.1-8B shaped
    (28, 5, [1, 7, 13, 19, 25]),
    (36, 3, [1, 17, 33]),
    (32, 4, [1, 10, 20, 29]),
    (8, 3, [1, 3, 5]),
    (36, 1, [18]),  # one-layer drafter: [L // 2]
    (4, 1, [2]),
    (7, 1, [3]),
    (4, 2, [1, 1]),  # L - 4 == 0: every id is 1
    (2, 3, [1, 0, 0]),  # a target shallower than the formula expects: clamped into range
]


@pytest.mark.parametrize("num_target, num_draft, expected", LAYER_ID_CASES)
def test_default_target_layer_ids(num_target, num_draft, expected):
    ids = default_target_layer_ids(num_target, num_draft)
    assert ids == expected
    assert all(0 <= i < num_target for i in ids)
    # The config uses the same default when target_layer_ids is not given.
    config = AdaFlashConfig(**{**BASE, "num_target_layers": num_target, "num_hidden_layers": num_draft})
    assert config.target_layer_ids == expected


@pytest.mark.parametrize("num_target, num_draft", [(0, 1), (4, 0)])
def test_default_target_layer_ids_rejects_empty(num_target, num_draft):
    with pytest.raises(ValueError, match="at least one"):
        default_target_layer_ids(num_target, num_draft)


ROUND_TRIP_CASES = [
    ("defaults", {}),
    ("explicit_ids_no_head", dict(target_layer_ids=[0, 2, 3], use_length_head=False, block_size=16)),
    ("length_fields", dict(length_head_dim=24, length_rate=0.5, length_min=3, length_head_trained=True)),
    ("rope", dict(rope_parameters={"rope_type": "default", "rope_theta": 12345.0}, max_position_embeddings=777)),
]


@pytest.mark.parametrize("overrides", [c[1] for c in ROUND_TRIP_CASES], ids=[c[0] for c in ROUND_TRIP_CASES])
def test_config_save_load_round_trip(tmp_path, overrides):
    config = AdaFlashConfig(**{**BASE, **overrides})
    config.save_pretrained(tmp_path)
    loaded = AdaFlashConfig.from_pretrained(tmp_path)
    fields = [
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "block_size",
        "num_target_layers", "target_layer_ids", "mask_token_id", "use_length_head", "length_head_dim",
        "length_head_trained", "length_rate", "length_min",
    ]  # fmt: skip
    for name in fields:
        assert getattr(loaded, name) == getattr(config, name), name
    assert loaded.rope_parameters["rope_theta"] == config.rope_parameters["rope_theta"]
    for name, value in overrides.items():
        got = getattr(loaded, name)
        if isinstance(value, dict):
            assert {k: got[k] for k in value} == value
        else:
            assert got == value, name


def test_config_load_revalidates(tmp_path):
    """A config.json edited by hand into an invalid state fails on load, naming the field."""
    import json

    AdaFlashConfig(**BASE).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data["target_layer_ids"] = [9]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"target_layer_ids \[9\]"):
        AdaFlashConfig.from_pretrained(tmp_path)
