"""docs/api.md against the live code: every public callable (``mkernel.__all__``, their public methods, the
listed module functions) appears there with its exact parameter list, and every signature the page shows
exists with that list -- so the reference cannot drift from the library."""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

import mkernel

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
# module-level functions users call that are not in mkernel.__all__
EXTRA = ["mkernel.ops.gemm.last_plan", "mkernel.ops.gemm.describe", "mkernel.ops.gemm.precompile",
         "mkernel.ops.ag_gemm.precompile",
         "mkernel.ops.attention.last_plan", "mkernel.core.compiler.precompile", "mkernel.dist.bootstrap.MpiBootstrap"]
_SIG_LINE = re.compile(r"^(mkernel(?:\.\w+)+)\((.*)\)\s*(?:->.*)?$")


def plain_signature(obj, drop_first: bool) -> str:
    """The parameter list as the page writes it: names, ``*`` markers and ``repr`` defaults, no annotations
    (a dataclass field's default factory as ``Factory()``)."""
    params = list(inspect.signature(obj).parameters.values())
    if drop_first and params and params[0].name in ("self", "cls"):
        params = params[1:]
    factories = {}
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        factories = {f.name: f"{f.default_factory.__name__}()" for f in dataclasses.fields(obj)
                     if f.default_factory is not dataclasses.MISSING}
    out, star = [], False
    for p in params:
        if p.kind is p.POSITIONAL_ONLY:
            raise AssertionError(f"{obj}: positional-only parameters are not rendered")
        if p.kind is p.VAR_POSITIONAL:
            out.append("*" + p.name)
            star = True
            continue
        if p.kind is p.VAR_KEYWORD:
            out.append("**" + p.name)
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        default = factories.get(p.name) or (repr(p.default) if p.default is not p.empty else None)
        out.append(p.name if default is None else f"{p.name}={default}")
    return ", ".join(out)


def _is_protocol(cls) -> bool:
    return bool(getattr(cls, "_is_protocol", False))


def _has_signature(obj) -> bool:
    try:
        inspect.signature(obj)
        return True
    except (TypeError, ValueError):
        return False


def expected() -> tuple[dict, list]:
    """``({dotted name: parameter list}, [property names])`` of everything public."""
    sigs, props = {}, []
    for name in mkernel.__all__:
        obj = getattr(mkernel, name)
        dotted = f"mkernel.{name}"
        if not inspect.isclass(obj):
            sigs[dotted] = plain_signature(obj, False)
            continue
        if not _is_protocol(obj) and "__init__" in vars(obj) or dataclasses.is_dataclass(obj):
            sigs[dotted] = plain_signature(obj, True)
        for attr, v in vars(obj).items():
            if attr.startswith("_"):
                continue
            if isinstance(v, property):
                props.append(f"{name}.{attr}")
            elif isinstance(v, classmethod) or inspect.isfunction(v):
                sigs[f"{dotted}.{attr}"] = plain_signature(getattr(obj, attr), inspect.isfunction(v))
    for dotted in EXTRA:
        obj = resolve(dotted)
        sigs[dotted] = plain_signature(obj, inspect.isclass(obj))
    return sigs, props


def resolve(dotted: str):
    """The object a dotted name names (the longest importable module prefix, then attributes)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            obj = getattr(obj, p)
        return obj
    raise ImportError(dotted)


def documented() -> dict:
    """``{dotted name: parameter list}`` of every signature line in the page's python code blocks."""
    out, in_code = {}, False
    for line in DOC.read_text().splitlines():
        if line.startswith("```"):
            in_code = line.strip() == "```python"
            continue
        m = _SIG_LINE.match(line.strip()) if in_code else None
        if m:
            assert m.group(1) not in out, f"{m.group(1)} is documented twice"
            out[m.group(1)] = m.group(2)
    return out


def test_every_public_callable_is_documented_with_its_exact_parameters():
    sigs, _ = expected()
    docs = documented()
    missing = sorted(set(sigs) - set(docs))
    assert not missing, "not in docs/api.md:\n" + "\n".join(f"  {n}({sigs[n]})" for n in missing)
    wrong = [f"  {n}: docs ({docs[n]})\n  {' ' * len(n)}  code ({sigs[n]})" for n in sorted(sigs) if docs[n] != sigs[n]]
    assert not wrong, "docs/api.md differs from the code:\n" + "\n".join(wrong)


def test_every_documented_signature_exists():
    docs = documented()
    stale = []
    for name, params in docs.items():
        try:
            obj = resolve(name)
        except (ImportError, AttributeError):
            stale.append(f"  {name}: no such object")
            continue
        parent = resolve(name.rsplit(".", 1)[0])
        member = inspect.isclass(parent) and not isinstance(inspect.getattr_static(parent, name.rsplit(".", 1)[1]),
                                                            (classmethod, staticmethod))
        live = plain_signature(obj, member or inspect.isclass(obj))
        if live != params:
            stale.append(f"  {name}: docs ({params}), code ({live})")
    assert not stale, "docs/api.md shows signatures the code does not have:\n" + "\n".join(stale)


def test_properties_and_signatureless_classes_are_named():
    _, props = expected()
    text = DOC.read_text()
    names = props + [f"mkernel.{n}" for n in mkernel.__all__ if not _has_signature(getattr(mkernel, n))]
    names += [f"mkernel.{n}" for n in mkernel.__all__ if _is_protocol(getattr(mkernel, n))]
    missing = [n for n in names if f"`{n}`" not in text]
    assert not missing, f"not named in docs/api.md: {missing}"


def test_the_renderer():
    def f(a, b=1, *, c="x", d=None, **kw):
        pass

    def g(*shape):
        pass

    assert plain_signature(f, False) == "a, b=1, *, c='x', d=None, **kw"
    assert plain_signature(g, False) == "*shape"
    assert plain_signature(mkernel.AgGemmOptions, True).endswith("model=CostModel()")


@pytest.mark.parametrize("name", ["init", "Context", "CollectiveOptions", "gemm", "ag_gemm", "gemm_reduce_scatter", "DeviceArray"])
def test_main_entries_have_a_section(name):
    assert f"### `mkernel.{name}`" in DOC.read_text()
