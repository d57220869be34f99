"""Tests of explain rows and their one formatter: short dtypes, dropped columns, 100 columns."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy._src.explain import (
    UNITS,
    ExplainRow,
    format_matmuls,
    format_rows,
    short_dtype,
    with_leaf,
)

WIDTH = 100


def test_tables_with_bytes_end_with_their_units_and_others_do_not():
    rows = [ExplainRow("m", "Dense", "float32", "default", "", "float32", "float32", 2048, 2048)]
    assert format_rows(rows).splitlines()[-1] == UNITS
    assert "K = 1024" in UNITS and "c.bytes" in UNITS
    no_leaves = [ExplainRow("m", "Dense", "float32", "default")]
    assert UNITS not in format_rows(no_leaves)


def _split_rows(text):
    """The table's rows as (full path, cells after the path), group lines joined back."""
    rows = []
    group = ""
    for line in text.splitlines()[1:]:
        if line.startswith("[") or line == UNITS:  # the legend, the units line
            continue
        if line.endswith("/") and "  " not in line:  # a group line: the parent path
            group = line
            continue
        cells = [c.strip() for c in line.split("  ") if c.strip()]
        path = group + cells[0] if line.startswith("  ") else cells[0]
        if not line.startswith("  "):
            group = ""
        rows.append((path, cells[1:]))
    return rows


def _legend(text):
    return dict(line.split(" ", 1) for line in text.splitlines() if line.startswith("["))


def test_row_fields_and_defaults():
    row = ExplainRow("enc/mlp")
    assert row._fields == (
        "path",
        "module_class",
        "policy",
        "source",
        "own_dtype",
        "stored",
        "compute",
        "nbytes",
        "compute_nbytes",
    )
    assert row == ("enc/mlp", "", "", "", "", "", "", 0, 0)


def test_with_leaf_counts_arrays_abstract_leaves_and_skips_scalars():
    row = ExplainRow("m", policy="mixed_bfloat16")
    row = with_leaf(row, jnp.ones((4, 4)), jnp.bfloat16)
    row = with_leaf(row, np.ones(3, np.float16), jnp.bfloat16)
    row = with_leaf(row, jax.ShapeDtypeStruct((2, 5), jnp.int32), jnp.bfloat16)
    row = with_leaf(row, 3.0, jnp.bfloat16)
    row = with_leaf(row, None, jnp.bfloat16)
    assert row.stored == "float16,float32,int32"
    assert row.compute == "bfloat16,int32"
    assert row.nbytes == 64 + 6 + 40
    assert row.compute_nbytes == 32 + 6 + 40


@pytest.mark.parametrize(
    "name, short",
    [
        ("float32", "f32"),
        ("bfloat16", "bf16"),
        ("float16", "f16"),
        ("float64", "f64"),
        ("int32", "i32"),
        ("uint8", "u8"),
        ("bool", "bool"),
        ("float8_e4m3fn", "f8_e4m3fn"),
        ("float32,int32", "f32,i32"),
        ("", ""),
    ],
)
def test_short_dtype(name, short):
    assert short_dtype(name) == short


def test_format_rows_drops_empty_columns_and_blanks_bytes_of_rows_without_leaves():
    rows = [
        ExplainRow("", "Model", "mixed_bfloat16", "default"),
        ExplainRow("body", "Dense", "mixed_bfloat16", "default", "", "float32", "bfloat16", 64, 32),
    ]
    lines = format_rows(rows).splitlines()
    assert lines[0].split() == ["path", "class", "policy", "source", "dtype", "bytes", "c.bytes"]
    assert lines[1].split() == ["<root>", "Model", "mixed_bfloat16", "default"]
    assert lines[2].split() == [
        "body",
        "Dense",
        "mixed_bfloat16",
        "default",
        "f32→bf16",
        "64",
        "32",
    ]
    assert lines[3].split() == ["total", "64", "32"]
    # The numbers are right-aligned under their headers.
    assert lines[2].endswith("64       32")
    assert len(lines[0]) == len(lines[2])


def test_format_rows_shows_own_dtype_in_short_form_and_bytes_in_binary_units():
    rows = [
        ExplainRow(
            "head",
            "Dense",
            "mixed_bfloat16",
            "default",
            "float32",
            "float32",
            "float32",
            3 * 2**20,
            3 * 2**20,
        ),
        ExplainRow(
            "body", "Dense", "mixed_bfloat16", "default", "", "float32", "bfloat16", 1536, 768
        ),
        ExplainRow(
            "big",
            "Dense",
            "mixed_bfloat16",
            "default",
            "",
            "float32",
            "bfloat16",
            150 * 2**30,
            75 * 2**30,
        ),
    ]
    lines = format_rows(rows).splitlines()
    assert lines[0].split() == [
        "path",
        "class",
        "policy",
        "source",
        "own",
        "dtype",
        "bytes",
        "c.bytes",
    ]
    assert lines[1].split()[4:] == ["f32", "f32", "3.0M", "3.0M"]
    assert lines[2].split()[4:] == ["f32→bf16", "1.5K", "768"]
    assert lines[3].split()[4:] == ["f32→bf16", "150G", "75G"]
    assert lines[4].split() == ["total", "150G", "75G"]


def test_format_rows_without_any_leaves_has_no_byte_columns_and_no_total():
    text = format_rows([ExplainRow("", "Model", "float32", "default")])
    assert text.splitlines() == [
        "path    class  policy   source",
        "<root>  Model  float32  default",
    ]


def _transformer_rows(layers=12):
    rows = [ExplainRow("", "TransformerLM", "p=f32,c=bf16,o=f32", "key ''")]
    for i in range(layers):
        block = f"Transformer_0/decoder/encoderdecoderblock_{i}"
        for name, cls in [
            ("MultiHeadDotProductAttention_0/query", "DenseGeneral"),
            ("MultiHeadDotProductAttention_0/key", "DenseGeneral"),
            ("MultiHeadDotProductAttention_0/value", "DenseGeneral"),
            ("MultiHeadDotProductAttention_0/out", "DenseGeneral"),
            ("MultiHeadDotProductAttention_0", "MultiHeadDotProductAttention"),
            ("MlpBlock_0/Dense_0", "Dense"),
            ("MlpBlock_0/Dense_1", "Dense"),
            ("LayerNorm_0", "LayerNorm"),
        ]:
            norm = cls == "LayerNorm"
            rows.append(
                ExplainRow(
                    f"{block}/{name}",
                    cls,
                    "float32" if norm else "mixed_bfloat16",
                    "type LayerNorm"
                    if norm
                    else r"key 'Transformer_0/decoder/encoderdecoderblock_\d+/.*'",
                    "float32",
                    "float32",
                    "float32" if norm else "bfloat16",
                    4 * 1024 * 4096,
                    (4 if norm else 2) * 1024 * 4096,
                )
            )
    return rows


def test_format_rows_fits_100_columns_on_a_transformer_and_keeps_every_path():
    rows = _transformer_rows()
    text = format_rows(rows)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    assert lines[0].split() == [
        "path",
        "class",
        "policy",
        "source",
        "own",
        "dtype",
        "bytes",
        "c.bytes",
    ]
    parsed = _split_rows(text)
    # Every path reads back whole; only a last segment too long for its column is shortened.
    expected = ["<root>"] + [r.path for r in rows[1:]] + ["total"]
    assert len(parsed) == len(expected)
    for (path, _), want in zip(parsed, expected, strict=True):
        if "…" in path:
            assert want.endswith("MultiHeadDotProductAttention_0")
            head, _, tail = path.partition("…")
            assert want.startswith(head) and want.endswith(tail)
        else:
            assert path == want
    rows_by_path = dict(parsed)
    query = rows_by_path[
        "Transformer_0/decoder/encoderdecoderblock_3/MultiHeadDotProductAttention_0/query"
    ]
    assert query == ["DenseGeneral", "mixed_bfloat16", "[1]", "f32", "f32→bf16", "16M", "8.0M"]
    norm = rows_by_path["Transformer_0/decoder/encoderdecoderblock_3/LayerNorm_0"]
    assert norm == ["LayerNorm", "float32", "type LayerNorm", "f32", "f32", "16M", "16M"]
    assert _legend(text) == {"[1]": r"key 'Transformer_0/decoder/encoderdecoderblock_\d+/.*'"}
    assert rows_by_path["total"] == ["1.5G", f"{(8 * 7 + 16) * 12}M"]  # 1536M, 864M


def _block_rows(i):
    """Rows of one block of colabs/02's transformer (a Linen MultiHeadDotProductAttention)."""
    f32, bf16 = "float32", "bfloat16"
    return [
        ExplainRow(f"layers_{i}", "Block", "mixed_bfloat16", "default"),
        ExplainRow(f"layers_{i}/norm1", "LayerNorm", f32, "type LayerNorm", "", f32, f32, 1024),
        ExplainRow(f"layers_{i}/attention", "MultiHeadDotProductAttention", "mixed_bfloat16"),
        *[
            ExplainRow(
                f"layers_{i}/attention/{name}",
                "DenseGeneral",
                "mixed_bfloat16",
                "default",
                "",
                f32,
                bf16,
                65536,
                32768,
            )
            for name in ("query", "key", "value", "out")
        ],
        ExplainRow(f"layers_{i}/mlp_in", "Dense", "mixed_bfloat16", "default", "", f32, bf16, 9),
    ]


@pytest.mark.parametrize(
    "module_class",
    ["MultiHeadDotProductAttention", "MultiHeadAttention", "ConvTranspose", "DenseGeneral"],
)
def test_format_rows_keeps_flax_class_names_whole_shrinking_paths_first(module_class):
    rows = [ExplainRow("", "Transformer", "mixed_bfloat16", "default")]
    rows += [row for i in range(2) for row in _block_rows(i)]
    rows = [
        r._replace(module_class=module_class) if "Attention" in r.module_class else r for r in rows
    ]
    rows.append(ExplainRow("head", "Dense", "float32", "key 'head'", "", "float32", "float32", 8))
    text = format_rows(rows)
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    assert "…" not in text
    parsed = dict(_split_rows(text))
    assert parsed["layers_1/attention"][0] == module_class
    assert parsed["layers_1/attention/query"][:2] == ["DenseGeneral", "mixed_bfloat16"]
    assert [path for path, _ in _split_rows(text)] == [r.path or "<root>" for r in rows] + ["total"]


def test_format_rows_cuts_a_class_name_only_when_nothing_else_can_shrink():
    policy = "float8_current_from_mixed_bfloat16"
    row = ExplainRow(
        "encoder/" + "x" * 40,
        "MultiHeadDotProductAttention",
        policy,
        "s" * 16,
        "float16",
        "float32",
        "bfloat16",
        1,
        1,
    )
    text = format_rows([row])
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    cls = text.splitlines()[2].split()[1]
    assert cls.startswith("MultiHe") and "…" in cls and len(cls) < 28  # cut, as a last resort


def test_format_rows_lists_long_sources_only_when_the_table_is_too_wide():
    long_source = "key 'encoder/layers_[0-9]+/attention'"
    narrow = format_rows([ExplainRow("enc", policy="float32", source=long_source)])
    assert long_source in narrow.splitlines()[1]
    assert _legend(narrow) == {}


@pytest.mark.parametrize("segment", [40, 99, 100, 150])
def test_format_rows_fits_100_columns_with_very_long_cells(segment):
    rows = [
        ExplainRow(
            "a" * segment + "/" + "b" * segment + "/c",
            "C" * segment,
            "p=f32,c=bf16,o=f32",
            "key '" + "x" * segment + "'",
            "float8_e4m3fn",
            "bfloat16,float32,float8_e4m3fn,int32",
            "bfloat16,float8_e4m3fn,int32",
            2**40,
            2**40,
        ),
        ExplainRow("short", "Dense", "float32", "default", "", "float32", "float32", 4, 4),
    ]
    text = format_rows(rows)
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    assert "short" in text
    total = next(line for line in text.splitlines() if line.startswith("total"))
    assert total.split() == ["total", "1.0T", "1.0T"]
    assert _legend(text)["[1]"].startswith("key 'xxx")


def test_map_explain_fits_100_columns_with_long_paths():
    tree = {
        "Transformer_0": {
            "decoder": {
                f"encoderdecoderblock_{i}": {
                    "MultiHeadDotProductAttention_0": {
                        name: {"kernel": jax.ShapeDtypeStruct((512, 8, 64), jnp.float32)}
                        for name in ("query", "key", "value")
                    },
                    "LayerNorm_0": {"scale": jax.ShapeDtypeStruct((512,), jnp.float32)},
                }
                for i in range(12)
            }
        }
    }
    m = jp.DTypePolicyMap(
        "mixed_bfloat16",
        {
            r"Transformer_0/decoder/encoderdecoderblock_\d+/LayerNorm_\d+": "float32",
            ".*/scale": "float32",
        },
    )
    text = m.explain(tree)
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    parsed = dict(_split_rows(text))
    key = "Transformer_0/decoder/encoderdecoderblock_11/MultiHeadDotProductAttention_0/query"
    assert parsed[key] == ["mixed_bfloat16", "default", "f32→bf16", "1.0M", "512K"]
    norm = parsed["Transformer_0/decoder/encoderdecoderblock_0/LayerNorm_0/scale"]
    assert norm == ["float32", "key '.*/scale'", "f32", "2.0K", "2.0K"]
    assert parsed["total"] == ["36M", "18M"]


FLOAT8_FORM = (
    "float8 (current), e4m3 x e4m3 GEMM 128x64x64; below 2048: bf16 may be faster; "
    "dims not multiples of 16: XLA pads them"
)


def test_format_matmuls_wraps_a_long_form_under_its_first_line_never_cutting_it():
    path = "encoder/layers_0/attention/query"
    text = format_matmuls({path: FLOAT8_FORM, "up": "int8 weights: weight-only, scale after"})
    lines = text.splitlines()
    assert lines[:2] == ["", "matmuls:"]
    assert all(len(line) <= 100 for line in lines)
    assert "…" not in text
    column = 2 + len(path) + 2
    assert lines[2].startswith(f"  {path}  float8 (current), e4m3 x e4m3 GEMM 128x64x64;")
    assert lines[3].startswith(" " * column) and lines[3][column] != " "
    # The words read back whole, in order.
    form = " ".join(line[column:] for line in lines[2:4])
    assert form == FLOAT8_FORM
    assert lines[4] == "  up" + " " * (len(path) - 2) + "  int8 weights: weight-only, scale after"


def test_format_matmuls_puts_forms_below_paths_too_long_to_leave_them_room():
    path = "/".join(["encoder", "layers_0", "attention", "query"] * 4)
    lines = format_matmuls({path: FLOAT8_FORM}).splitlines()
    assert lines[2] == f"  {path}"
    assert all(line.startswith("      ") and len(line) <= 100 for line in lines[3:])
    assert " ".join(line.strip() for line in lines[3:]) == FLOAT8_FORM
