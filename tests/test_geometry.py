"""memtree.geometry accounting against the paper's own numbers (seed 002).

Every expected number below is typed in from the paper's tables (App. A Tables 4–8,
Tables 1–3, App. D) or from the hand formulas of App. I and seeds/README.md; none was
produced by running the code. Where the paper rounds (Tables 1, 2, 3, 7) we compare at
the paper's precision.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from memtree.cli import main
from memtree.geometry import (
    ANCHOR_PRESETS,
    AnchorShape,
    MemoryConfig,
    block_layout,
    get_anchor,
    human,
    human_bytes,
    join_block,
    layer_widths,
    memory_layers,
    parse_multipliers,
    plan,
    split_block,
    stored_bytes,
)


def _b(n: int) -> float:  # billions, paper precision (one decimal)
    return round(n / 1e9, 1)


def _m(n: int) -> float:  # millions, one decimal
    return round(n / 1e6, 1)


# --- Tables 4–6: anchor parameter counts -------------------------------------------------------


@pytest.mark.parametrize(
    "name, params",
    [
        ("openlm-160m", 163_510_016),  # Table 4
        ("openlm-410m", 411_665_408),  # Table 5
        ("openlm-1.4b", 1_439_893_504),  # Table 6
    ],
)
def test_anchor_params_tables_4_to_6(name, params):
    assert get_anchor(name).params() == params


def test_anchor_shapes_tables_4_to_6():
    a = get_anchor("openlm-160m")
    assert (a.n_layers, a.d_model, a.n_heads, a.head_dim, a.ffn_dim, a.tied_embeddings) == (
        35,
        512,
        12,
        32,
        2048,
        True,
    )
    a = get_anchor("openlm-410m")
    assert (a.n_layers, a.d_model, a.n_heads, a.head_dim, a.ffn_dim, a.tied_embeddings) == (
        24,
        1024,
        16,
        64,
        2816,
        False,
    )
    a = get_anchor("openlm-1.4b")
    assert (a.n_layers, a.d_model, a.n_heads, a.head_dim, a.ffn_dim, a.tied_embeddings) == (
        24,
        2048,
        16,
        128,
        5632,
        False,
    )


# --- Table 8: memory-to-model size, exact integers ---------------------------------------------

TABLE_8 = [
    # anchor, layers, num params, config, fetch, bank, runtime
    (
        "openlm-410m-l12",
        12,
        257_475_584,
        (3840, 336, 6, 0),
        154_165_248,
        6_341_787_648,
        411_640_832,
    ),
    ("openlm-410m-l17", 17, 321_721_344, (1445, 256, 8, 0), 89_250_816, 6_341_246_976, 410_972_160),
    ("openlm-410m-l19", 19, 347_419_648, (870, 226, 9, 0), 64_496_640, 6_341_099_520, 411_916_288),
    ("openlm-410m-l21", 21, 373_117_952, (384, 200, 10, 0), 38_320_128, 6_341_787_648, 411_438_080),
    ("openlm-410m-l22", 22, 385_967_104, (264, 94, 16, 0), 25_276_416, 6_341_001_216, 411_243_520),
    ("openlm-410m", 24, 411_665_408, (0, 0, 0, 0), 0, 0, 411_665_408),
]


@pytest.mark.parametrize("anchor, n_layers, params, config, fetch, bank, runtime", TABLE_8)
def test_table_8_exact(anchor, n_layers, params, config, fetch, bank, runtime):
    p = plan(anchor, config, type="ffn")
    assert p.anchor.n_layers == n_layers
    assert p.anchor_params == params
    assert p.fetch_params == fetch
    assert p.bank_params == bank
    assert p.runtime_params == runtime
    assert p.to_dict()["runtime_params"] == runtime


# --- Table 1: co-training rows A2 / B2 / C2 ----------------------------------------------------


@pytest.mark.parametrize(
    "anchor, config, bank_b, fetch_m",
    [
        ("openlm-160m", (256, 64, 16, 0), 4.6, 18),  # A2
        ("openlm-410m", (512, 128, 32, 0), 12.7, 50),  # B2
        ("openlm-1.4b", (768, 256, 16, 0), 21.1, 153),  # C2
    ],
)
def test_table_1(anchor, config, bank_b, fetch_m):
    p = plan(anchor, config)
    assert _b(p.bank_params) == bank_b
    assert round(p.fetch_params / 1e6) == fetch_m


# --- Table 7: hierarchical configurations on the frozen 160M anchor ----------------------------

TABLE_7_GROUP_46 = [  # bank 4.6B
    ((0, 16, 4, 1), 1.1),
    ((98, 42, 18, 0), 8.5),
    ((256, 64, 16, 0), 18.1),
    ((768, 96, 12, 0), 47.1),
    ((1792, 112, 7, 0), 102.7),
    ((5376, 0, 0, 0), 289),
]
TABLE_7_GROUP_187 = [  # bank 18.7B; (256,64,16,4) is handled separately below
    ((328, 156, 74, 0), 30),
    ((1216, 164, 22, 3), 75.5),
    ((4096, 320, 17, 2), 238.4),
]


@pytest.mark.parametrize("config, fetch_m", TABLE_7_GROUP_46)
def test_table_7_bank_4_6b(config, fetch_m):
    p = plan("openlm-160m", config, type="ffn")
    assert _b(p.bank_params) == 4.6
    assert _m(p.fetch_params) == fetch_m


@pytest.mark.parametrize("config, fetch_m", TABLE_7_GROUP_187)
def test_table_7_bank_18_7b(config, fetch_m):
    p = plan("openlm-160m", config, type="ffn")
    assert _b(p.bank_params) == 18.7
    assert _m(p.fetch_params) == fetch_m


def test_table_7_row_256_64_16_4():
    # Table 7 prints fetch 18.1M for (256,64,16,4), the same figure as (256,64,16,0). The level-4
    # block adds 3·512·4·35 = 215,040 parameters, so the true fetch is 18.28M (18.3 at the
    # table's precision): the table repeats the level-1–3 fetch. Its bank, 18.7B, is right.
    p = plan("openlm-160m", (256, 64, 16, 4))
    assert _b(p.bank_params) == 18.7
    assert p.levels[3].block_params == 3 * 512 * 4 * 35
    assert _m(p.fetch_params - p.levels[3].block_params) == 18.1
    assert _m(p.fetch_params) == 18.3


# --- Table 3: memory bank storage in bf16 ------------------------------------------------------


@pytest.mark.parametrize(
    "anchor, config, gb",
    [
        ("openlm-160m", (256, 64, 16, 0), 9),
        ("openlm-410m", (512, 128, 32, 0), 25),
        ("openlm-1.4b", (768, 256, 16, 0), 42),
    ],
)
def test_table_3_bank_bytes_bf16(anchor, config, gb):
    p = plan(anchor, config)
    assert round(p.bank_bytes("bf16") / 1e9) == gb
    assert p.bank_bytes("bf16") == 2 * p.bank_params


# --- Table 2: post-hoc memories on open-weight models ------------------------------------------


@pytest.mark.parametrize(
    "anchor, config, bank_b, fetch_m",
    [
        ("gemma3-270m", (512, 128, 32, 0), 5.9, 23.2),
        ("qwen2.5-0.5b", (512, 128, 32, 0), 11.1, 43.4),
        ("llama3.2-1b", (768, 256, 16, 0), 14.1, 102.2),
    ],
)
def test_table_2(anchor, config, bank_b, fetch_m):
    p = plan(anchor, config, type="ffn")
    assert _b(p.bank_params) == bank_b
    assert _m(p.fetch_params) == fetch_m


def test_table_2_llama_config_in_text_does_not_reproduce_table():
    # App. A.6 says Llama used (768, 256, 32, 0); that gives 20.5B / 103.8M, not Table 2's
    # 14.1B / 102.2M. Level 3 = 16 reproduces the table, so the text's "32" is a typo.
    text = plan("llama3.2-1b", (768, 256, 32, 0))
    assert (_b(text.bank_params), _m(text.fetch_params)) == (20.5, 103.8)
    assert (_b(text.bank_params), _m(text.fetch_params)) != (14.1, 102.2)
    table = plan("llama3.2-1b", (768, 256, 16, 0))
    assert (_b(table.bank_params), _m(table.fetch_params)) == (14.1, 102.2)


# --- App. D: (0,0,16,0) on the 160M anchor -----------------------------------------------------


def test_app_d_level3_memories():
    p = plan("openlm-160m", (0, 0, 16, 0))
    lv = p.levels[2]
    assert lv.n_blocks == 4_096
    assert lv.block_params == 860_160
    assert [x.n_blocks for x in p.levels] == [0, 0, 4_096, 0]
    assert _b(p.bank_params) == 3.5
    assert p.fetch_params == 860_160


# --- seeds/README.md: FFN block = 3·d·m·L, bank = Σ 16^l · m_l blocks' worth ------------------


@pytest.mark.parametrize("anchor", ["openlm-160m", "openlm-410m", "openlm-1.4b", "openlm-410m-l17"])
@pytest.mark.parametrize("config", [(256, 64, 16, 0), (7, 3, 2, 1), (0, 0, 0, 5)])
def test_readme_ffn_formula(anchor, config):
    a = get_anchor(anchor)
    unit = 3 * a.d_model * a.n_layers  # one multiplier's worth
    p = plan(a, config, type="ffn")
    assert [lv.block_params for lv in p.levels] == [unit * m for m in config]
    assert p.fetch_params == unit * sum(config)
    assert p.bank_params == unit * sum(16**lv * m for lv, m in enumerate(config, start=1))
    assert [lv.n_blocks for lv in p.levels] == [
        16**lv if m else 0 for lv, m in enumerate(config, 1)
    ]


def test_branching_other_than_16():
    a = get_anchor("openlm-160m")
    p = plan(a, (2, 1), branching=4)
    unit = 3 * 512 * 35
    assert p.bank_params == unit * (4 * 2 + 16 * 1)


# --- App. F: memory placement ------------------------------------------------------------------


def test_app_f_placements_keep_uniform_budget():
    a = get_anchor("openlm-160m")
    uniform = plan(a, (0, 64, 0, 0))
    assert uniform.fetch_params == 3 * 512 * 64 * 35
    expected_layers = {
        "early": list(range(10)),
        "middle": list(range(12, 22)),
        "late": list(range(25, 35)),
    }
    for placement, layers in expected_layers.items():
        p = plan(a, (0, 64, 0, 0), placement=placement, placement_layers=10)
        assert list(p.memory_layers) == layers, placement
        assert p.fetch_params == uniform.fetch_params, placement
        assert p.bank_params == uniform.bank_params, placement
        widths = layer_widths(a, p.memory, 64)
        assert sorted(widths) == layers
        assert set(widths.values()) == {64 * 35 // 10}  # 224: divides evenly
        names = {t.name.split(".")[1] for t in block_layout(a, p.memory, 2)}
        assert names == {str(i) for i in layers}


def test_app_f_explicit_layers_and_remainder():
    a = get_anchor("openlm-160m")
    mem = MemoryConfig(multipliers=(0, 64, 0, 0), placement="explicit", layers=(9, 0, 5))
    assert memory_layers(a, mem) == [0, 5, 9]
    widths = layer_widths(a, mem, 64)
    assert sum(widths.values()) == 64 * 35  # 2240 = 747 + 747 + 746
    assert sorted(widths.values()) == [746, 747, 747]
    assert plan(a, mem).fetch_params == 3 * 512 * 64 * 35


def test_app_f_preserve_total_false():
    a = get_anchor("openlm-160m")
    mem = MemoryConfig(multipliers=(0, 64, 0, 0), placement="late", preserve_total=False)
    assert layer_widths(a, mem, 64) == {i: 64 for i in range(25, 35)}
    assert plan(a, mem).fetch_params == 3 * 512 * 64 * 10
    mem = MemoryConfig(multipliers=(8,), placement="explicit", layers=(1, 2), preserve_total=False)
    assert plan(a, mem).fetch_params == 3 * 512 * 8 * 2


@pytest.mark.parametrize("layers", [(35,), (-1,), (0, 0)])
def test_app_f_bad_explicit_layers(layers):
    mem = MemoryConfig(multipliers=(0, 64, 0, 0), placement="explicit", layers=layers)
    with pytest.raises(ValueError, match="memory.layers"):
        plan("openlm-160m", mem)


def test_app_f_bad_placement_layers():
    with pytest.raises(ValueError, match="placement_layers"):
        plan("openlm-160m", (0, 64, 0, 0), placement="early", placement_layers=36)


# --- App. I: LoRA and KV memory sizes ----------------------------------------------------------


def _lora_kv_per_layer(d, f, h, h_kv, dh, r):
    return {
        "lora-qk": r * (d + h * dh) + r * (d + h_kv * dh),
        "lora-ov": r * (d + h_kv * dh) + r * (h * dh + d),
        "lora-ffn": 3 * r * (d + f),
        "kv": 2 * r * h_kv * dh,
        "ffn": 3 * d * r,
    }


@pytest.mark.parametrize("kind", ["lora-qk", "lora-ov", "lora-ffn", "kv", "ffn"])
def test_app_i_openlm_160m_no_gqa(kind):
    d, f, h, dh, n = 512, 2048, 12, 32, 35
    r = 8
    expected = {
        "lora-qk": 2 * r * (d + h * dh) * n,
        "lora-ov": 2 * r * (d + h * dh) * n,
        "lora-ffn": 3 * r * (d + f) * n,
        "kv": 2 * r * h * dh * n,
        "ffn": 3 * d * r * n,
    }[kind]
    p = plan("openlm-160m", (0, r, 0, 0), type=kind)
    assert p.fetch_params == expected
    assert p.bank_params == 256 * expected


@pytest.mark.parametrize("anchor", ["llama3.2-1b", "qwen2.5-0.5b", "gemma3-270m"])
@pytest.mark.parametrize("kind", ["lora-qk", "lora-ov", "lora-ffn", "kv", "ffn"])
def test_app_i_gqa(anchor, kind):
    a = get_anchor(anchor)
    r = 5
    per_layer = _lora_kv_per_layer(a.d_model, a.ffn_dim, a.n_heads, a.n_kv_heads, a.head_dim, r)
    p = plan(a, (r, 0), type=kind)
    assert p.fetch_params == per_layer[kind] * a.n_layers


# --- block_layout ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ffn", "lora-qk", "lora-ov", "lora-ffn", "kv"])
def test_block_layout_sums_to_block_params(kind):
    a = get_anchor("openlm-160m")
    mem = MemoryConfig(multipliers=(256, 64, 16, 0), type=kind)
    p = plan(a, mem)
    for lv in p.levels:
        layout = block_layout(a, mem, lv.level)
        assert sum(t.numel for t in layout) == lv.block_params
        assert len({t.name for t in layout}) == len(layout)
    assert block_layout(a, mem, 4) == []


def test_block_layout_ffn_shapes():
    a = get_anchor("openlm-160m")
    mem = MemoryConfig(multipliers=(256, 64, 16, 0))
    layout = block_layout(a, mem, 2)
    assert len(layout) == 3 * 35
    assert all(t.shape == (64, 512) for t in layout)
    assert [t.name for t in layout[:3]] == ["layers.0.w1", "layers.0.w2", "layers.0.w3"]
    assert layout[-1].name == "layers.34.w3"


# --- stored_bytes ------------------------------------------------------------------------------


def test_stored_bytes_float():
    n = 860_160
    assert stored_bytes(n, "fp32") == 3_440_640
    assert stored_bytes(n, "bf16") == 1_720_320
    assert stored_bytes(n, "fp16") == 1_720_320


def test_stored_bytes_quantised_include_scales():
    n = 860_160  # 6,720 groups of 128 exactly → 26,880 bytes of fp32 scales
    assert stored_bytes(n, "int8") == 860_160 + 26_880
    assert stored_bytes(n, "int4") == 430_080 + 26_880
    # partial last group and odd count: 1,001 elements → 8 groups, 501 int4 bytes
    assert stored_bytes(1_001, "int8") == 1_001 + 32
    assert stored_bytes(1_001, "int4") == 501 + 32
    assert stored_bytes(128, "int8") == 128 + 4
    assert stored_bytes(129, "int4") == 65 + 8


def test_plan_bytes_per_block():
    p = plan("openlm-160m", (0, 0, 16, 0))
    assert p.fetch_bytes("int8") == 887_040
    assert p.bank_bytes("int8") == 4_096 * 887_040
    assert p.bank_bytes("fp32") == 4 * p.bank_params


def test_stored_bytes_unknown_dtype():
    with pytest.raises(ValueError, match="fp8"):
        stored_bytes(10, "fp8")


# --- validation --------------------------------------------------------------------------------


def test_negative_multiplier():
    with pytest.raises(ValueError, match="non-negative"):
        MemoryConfig(multipliers=(256, -1, 0, 0))


def test_unknown_type():
    with pytest.raises(ValueError, match="lora-xx.*ffn"):
        MemoryConfig(multipliers=(1,), type="lora-xx")


def test_unknown_preset():
    with pytest.raises(ValueError, match="openlm-999m.*openlm-160m"):
        get_anchor("openlm-999m")
    with pytest.raises(ValueError, match="unknown anchor"):
        plan("openlm-999m", (1,))


def test_other_validation():
    with pytest.raises(ValueError, match="multipliers"):
        MemoryConfig(multipliers=())
    with pytest.raises(ValueError, match="branching"):
        MemoryConfig(multipliers=(1,), branching=1)
    with pytest.raises(ValueError, match="explicit"):
        MemoryConfig(multipliers=(1,), placement="explicit")
    with pytest.raises(ValueError, match="explicit"):
        MemoryConfig(multipliers=(1,), placement="late", layers=(1,))
    with pytest.raises(ValueError, match="n_kv_heads"):
        AnchorShape(n_layers=2, d_model=8, n_heads=4, n_kv_heads=3, head_dim=2, ffn_dim=16)
    with pytest.raises(ValueError, match="d_model"):
        AnchorShape(n_layers=2, d_model=0, n_heads=4, head_dim=2, ffn_dim=16)


def test_parse_multipliers():
    assert parse_multipliers("256,64,16,0") == (256, 64, 16, 0)
    assert parse_multipliers("(256, 64, 16, 0)") == (256, 64, 16, 0)
    with pytest.raises(ValueError, match="comma-separated"):
        parse_multipliers("256,x")


def test_presets_named_consistently():
    assert all(a.name == k for k, a in ANCHOR_PRESETS.items())


# --- CLI ---------------------------------------------------------------------------------------

SHAPE_160M = "n_layers=35,d_model=512,n_heads=12,head_dim=32,ffn_dim=2048"


def _plan_cli(*extra):
    return main(["memstore", "plan", "--memory", "256,64,16,0", "--type", "ffn", *extra])


def test_cli_plan_text(capsys):
    assert _plan_cli("--anchor", "openlm-160m") == 0
    out = capsys.readouterr().out
    assert "4,624,220,160" in out
    assert "18,063,360" in out
    assert "163,510,016" in out


def test_cli_plan_json(capsys):
    assert _plan_cli("--anchor", "openlm-160m", "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["bank_params"] == 4_624_220_160
    assert d["fetch_params"] == 18_063_360
    assert d["anchor_params"] == 163_510_016
    assert d["memory"]["multipliers"] == [256, 64, 16, 0]
    assert [lv["n_blocks"] for lv in d["levels"]] == [16, 256, 4096, 0]
    assert d["bytes"]["bf16"]["bank"] == 2 * 4_624_220_160


def test_cli_plan_explicit_shape(capsys):
    assert _plan_cli("--anchor", "openlm-160m", "--json") == 0
    preset = json.loads(capsys.readouterr().out)
    assert _plan_cli("--anchor", SHAPE_160M, "--json") == 0
    shape = json.loads(capsys.readouterr().out)
    preset.pop("anchor"), shape.pop("anchor")
    assert shape == preset
    # a non-default key: untying the embeddings adds one vocab × d matrix
    assert _plan_cli("--anchor", SHAPE_160M + ",tied_embeddings=false", "--json") == 0
    untied = json.loads(capsys.readouterr().out)
    assert untied["anchor_params"] == 163_510_016 + 50_432 * 512


def test_cli_plan_unknown_shape_key(capsys):
    assert _plan_cli("--anchor", SHAPE_160M + ",n_experts=8") == 1
    err = capsys.readouterr().err
    assert "n_experts" in err
    assert "n_kv_heads" in err  # lists the allowed keys


def test_cli_plan_missing_shape_key_and_unknown_preset(capsys):
    assert _plan_cli("--anchor", "n_layers=35,d_model=512") == 1
    assert "ffn_dim" in capsys.readouterr().err
    assert _plan_cli("--anchor", "openlm-999m") == 1
    assert "openlm-999m" in capsys.readouterr().err


def test_cli_plan_placement(capsys):
    args = ["memstore", "plan", "--anchor", "openlm-160m", "--memory", "0,64,0,0", "--json"]
    assert main(args + ["--placement", "late", "--placement-layers", "10"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["memory_layers"] == list(range(25, 35))
    assert d["fetch_params"] == 3 * 512 * 64 * 35
    assert main(args + ["--layers", "0,5,9", "--no-preserve-total"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["memory"]["placement"] == "explicit"
    assert d["memory_layers"] == [0, 5, 9]
    assert d["fetch_params"] == 3 * 512 * 64 * 3
    assert main(args + ["--layers", "0,35"]) == 1
    assert "memory.layers" in capsys.readouterr().err


def test_cli_plan_lora_and_branching(capsys):
    assert (
        main(
            [
                "memstore",
                "plan",
                "--anchor",
                "openlm-160m",
                "--memory",
                "0,8",
                "--type",
                "lora-ffn",
                "--branching",
                "4",
                "--json",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    assert d["fetch_params"] == 3 * 8 * (512 + 2048) * 35
    assert d["bank_params"] == 16 * d["fetch_params"]


def test_cli_plan_bad_memory(capsys):
    assert main(["memstore", "plan", "--anchor", "openlm-160m", "--memory", "1,-2"]) == 1
    assert "non-negative" in capsys.readouterr().err


def test_cli_memstore_without_subcommand(capsys):
    assert main(["memstore"]) == 2
    assert "plan" in capsys.readouterr().out


def test_human_rounding_sanity():
    # the paper-style short forms used in format_plan
    assert human(4_624_220_160) == "4.6B"
    assert human(18_063_360) == "18.1M"
    assert human_bytes(9_000_000_000) == "9.0 GB"


# --- split_block / join_block: the flat block ↔ named tensors -----------------------------------

_SMALL = AnchorShape(
    name="small-test", n_layers=3, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=32
)


@pytest.mark.parametrize("kind", ["ffn", "lora-qk", "kv"])
def test_split_join_block_round_trip_torch(kind):
    import torch

    layout = block_layout(
        _SMALL, MemoryConfig(multipliers=(4,), type=kind, placement="late", placement_layers=2), 1
    )
    params = sum(t.numel for t in layout)
    flat = torch.randn(5, params)
    parts = split_block(layout, flat)
    assert list(parts) == [t.name for t in layout]
    off = 0
    for t in layout:  # each part is a view of its span, row-major
        assert parts[t.name].shape == (5, *t.shape)
        assert parts[t.name].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert torch.equal(parts[t.name].reshape(5, -1), flat[:, off : off + t.numel])
        off += t.numel
    assert torch.equal(join_block(layout, parts), flat)
    one = split_block(layout, flat[0])  # no leading dims
    assert torch.equal(join_block(layout, one), flat[0])


def test_split_join_block_numpy_matches_torch():
    import torch

    layout = block_layout(_SMALL, MemoryConfig(multipliers=(4,), type="lora-ffn"), 1)
    flat = np.arange(2 * sum(t.numel for t in layout), dtype=np.float32).reshape(2, -1)
    parts = split_block(layout, flat)
    tparts = split_block(layout, torch.from_numpy(flat))
    for name, p in parts.items():
        assert np.array_equal(p, tparts[name].numpy())
    assert np.array_equal(join_block(layout, parts), flat)
    with pytest.raises(ValueError, match="layout needs"):
        split_block(layout, flat[:, :-1])
    with pytest.raises(ValueError, match="missing"):
        join_block(layout, {k: v for k, v in parts.items() if k != layout[0].name})


def test_geometry_imports_no_torch_or_numpy():
    code = "import sys, memtree.geometry; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
