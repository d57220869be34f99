"""The public API: the documented names, their docstrings, and a flax-free import."""

import inspect
import os
import pathlib
import subprocess
import sys

import pytest

import jmp_policy as jp

# DESIGN.md's "Policies", "Global policy" and "Serialization" sections. Other sections add
# names too; this pins the ones of the foundation.
DOCUMENTED = [
    # Policies
    "DTypePolicy",
    "FloatDTypePolicy",
    "Policy",
    "QuantizedDTypePolicy",
    "QuantizedFloat8DTypePolicy",
    "Int4DTypePolicy",
    "GPTQDTypePolicy",
    "AWQDTypePolicy",
    "SmoothQuantDTypePolicy",
    "get",
    "get_policy",
    "serialize",
    "deserialize",
    # Global policy
    "set_dtype_policy",
    "dtype_policy",
    "set_global_policy",
    "global_policy",
    "policy_scope",
    # DTypePolicyMap and applying policies
    "DTypePolicyMap",
    "cast_apply",
    "current_policy",
    # Quantized policies
    "QuantizedArray",
    "quantized_metadata",
    "rebuild_quantized",
    # Diagnostics
    "format_report",
    "dtype_profile",
]

FLAX_MODULES = {
    "linen": ["apply", "init", "explain", "diagnose", "NORM_FLOAT32", "quantize", "search_map"],
    "nnx": [
        "apply",
        "explain",
        "diagnose",
        "NORM_FLOAT32",
        "init_float8",
        "split_gradients",
        "Float8State",
        "quantize",
        "search_map",
    ],
    "equinox": [
        "apply",
        "calibrate",
        "diagnose",
        "explain",
        "quantize",
        "search_map",
        "NORM_FLOAT32",
    ],
}

POLICY_MEMBERS = [
    "name",
    "compute_dtype",
    "variable_dtype",
    "param_dtype",
    "output_dtype",
    "quantization_mode",
    "cast_to_compute",
    "cast_to_variable",
    "cast_to_param",
    "cast_to_output",
    "with_compute_dtype",
    "with_variable_dtype",
    "with_output_dtype",
    "get_config",
    "from_config",
    "quantize",
]


@pytest.mark.parametrize("name", DOCUMENTED)
def test_documented_name_is_exported(name):
    assert name in jp.__all__
    assert hasattr(jp, name)


def test_all_names_are_attributes_without_duplicates():
    assert len(jp.__all__) == len(set(jp.__all__))
    missing = [name for name in jp.__all__ if not hasattr(jp, name)]
    assert missing == []


@pytest.mark.parametrize("name", sorted(set(jp.__all__)))
def test_public_name_has_docstring_with_example(name):
    doc = inspect.getdoc(getattr(jp, name))
    assert doc, f"{name} has no docstring"
    assert ">>>" in doc, f"{name}'s docstring has no example"


def test_module_docstring_has_example():
    assert ">>>" in (jp.__doc__ or "")


@pytest.mark.parametrize(
    "cls",
    [
        jp.DTypePolicy,
        jp.FloatDTypePolicy,
        jp.Policy,
        jp.QuantizedDTypePolicy,
        jp.QuantizedFloat8DTypePolicy,
        jp.Int4DTypePolicy,
        jp.GPTQDTypePolicy,
        jp.AWQDTypePolicy,
        jp.SmoothQuantDTypePolicy,
    ],
)
@pytest.mark.parametrize("member", POLICY_MEMBERS)
def test_every_policy_class_has_documented_member(cls, member):
    assert hasattr(cls, member)


def test_policy_classes_are_one_family():
    for cls in (jp.FloatDTypePolicy, jp.Policy, jp.QuantizedDTypePolicy):
        assert issubclass(cls, jp.DTypePolicy)
    assert issubclass(jp.QuantizedFloat8DTypePolicy, jp.QuantizedDTypePolicy)
    assert issubclass(jp.Int4DTypePolicy, jp.QuantizedDTypePolicy)
    assert issubclass(jp.GPTQDTypePolicy, jp.QuantizedDTypePolicy)
    assert issubclass(jp.AWQDTypePolicy, jp.QuantizedDTypePolicy)
    assert issubclass(jp.SmoothQuantDTypePolicy, jp.QuantizedDTypePolicy)


def test_version_is_a_string():
    assert isinstance(jp.__version__, str)
    assert jp.__version__.count(".") >= 1


def test_unknown_attribute_raises_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        jp.not_a_name  # noqa: B018


def _run_python(code):
    """Runs ``code`` in a fresh interpreter (nothing imported yet) from the repository."""
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env
    )


def test_import_does_not_import_flax():
    result = _run_python(
        "import sys, jmp_policy; "
        "assert 'flax' not in sys.modules, sorted(m for m in sys.modules if 'flax' in m)"
    )
    assert result.returncode == 0, result.stderr


def test_equinox_is_imported_only_when_jp_equinox_is_used():
    result = _run_python(
        "import sys, jmp_policy as jp; assert 'equinox' not in sys.modules; "
        "jp.equinox.apply; assert 'equinox' in sys.modules; print('ok')"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_jp_equinox_without_equinox_is_an_import_error_naming_the_extra():
    result = _run_python(
        "import sys; sys.modules['equinox'] = None; import jmp_policy as jp\n"
        "try:\n    jp.equinox\nexcept ImportError as e:\n    print(e)"
    )
    assert result.returncode == 0, result.stderr
    assert "pip install jmp_policy[equinox]" in result.stdout


def test_flax_integrations_are_lazy_attributes():
    result = _run_python(
        "import sys, jmp_policy as jp; assert 'flax' not in sys.modules; "
        "jp.linen.apply; assert 'flax.linen' in sys.modules; jp.nnx.apply; print('ok')"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize(
    ("module", "name"), [(m, n) for m, names in FLAX_MODULES.items() for n in names]
)
def test_flax_integration_names_are_exported_and_documented(module, name):
    integration = getattr(jp, module)
    assert name in integration.__all__
    doc = inspect.getdoc(getattr(integration, name))
    if name == "NORM_FLOAT32":  # a mapping: its module docstring shows it in use
        doc = integration.__doc__
    assert doc and ">>>" in doc


def test_dir_shows_public_names_and_lazy_integrations_only():
    names = dir(jp)
    assert names == sorted(names)
    for name in ("Any", "annotations", "importlib", "_src", "_LAZY_SUBMODULES"):
        assert name not in names
    assert set(jp.__all__) <= set(names)
    assert {"linen", "nnx", "equinox", "__version__"} <= set(names)
    public = [n for n in names if not n.startswith("__")]
    assert sorted(public) == sorted([*jp.__all__, "linen", "nnx", "equinox"])


def test_dir_does_not_import_flax():
    result = _run_python(
        "import sys, jmp_policy as jp; names = dir(jp); "
        "assert 'flax' not in sys.modules; assert 'linen' in names; print('ok')"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("module", ["linen", "nnx", "equinox"])
def test_flax_integrations_show_their_public_names_only(module):
    integration = getattr(jp, module)
    assert set(dir(integration)) == set(integration.__all__)
    for leaked in ("np", "jax", "casting", "dt", "nn", "nnx", "annotations", "Any"):
        assert leaked not in dir(integration)
