"""What a peer or a config can make Flywheel run: nothing is unpickled, nothing is evaluated, and
the reward function's import path is the only code a config names.

The source of every shipped package is parsed (not grepped) and each call is checked."""

from __future__ import annotations

import ast
from pathlib import Path

from flywheel.config import FlywheelConfig, reference

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["flywheel", "buffer", "generators", "learner", "reward_service", "bench"]
# The one module that imports code a config names (reward.functions 'pkg.module:fn').
IMPORTER = "reward_service/registry.py"

UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
UNSAFE_BUILTINS = {"eval", "exec", "compile"}
UNSAFE_YAML = {"load", "load_all", "full_load", "full_load_all", "unsafe_load", "unsafe_load_all"}
# ... of a name only known at run time (a constant string names code that ships)
CODE_LOADERS = {"__import__", "import_module", "spec_from_file_location", "exec_module", "run_module", "run_path"}


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_const(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def violations(source: str, path: str) -> list[str]:
    """Every unsafe construct in ``source``, as 'path:line: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                if name.split(".")[0] in UNSAFE_MODULES:
                    found.append(f"{path}:{line}: imports {name} (deserialises code)")
            if isinstance(node, ast.ImportFrom) and node.module == "yaml":
                found += [f"{path}:{line}: from yaml import {a.name}" for a in node.names if a.name in UNSAFE_YAML]
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
        owner = fn.value.id if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) else ""
        if isinstance(fn, ast.Name) and name in UNSAFE_BUILTINS:
            found.append(f"{path}:{line}: {name}()")
        if owner == "yaml" and name in UNSAFE_YAML:
            found.append(f"{path}:{line}: yaml.{name} (use yaml.safe_load)")
        if owner == "torch" and name == "load" and not _is_const(_kw(node, "weights_only"), True):
            found.append(f"{path}:{line}: torch.load without weights_only=True")
        if owner in ("np", "numpy") and name == "load" and _is_const(_kw(node, "allow_pickle"), True):
            found.append(f"{path}:{line}: np.load(allow_pickle=True)")
        computed = not (node.args and isinstance(node.args[0], ast.Constant))
        if name in CODE_LOADERS and computed and path != IMPORTER:
            found.append(f"{path}:{line}: {name}() loads code outside {IMPORTER}")
        if _kw(node, "trust_remote_code") is not None and not _is_const(_kw(node, "trust_remote_code"), False):
            found.append(f"{path}:{line}: trust_remote_code other than False")
        if _kw(node, "shell") is not None and not _is_const(_kw(node, "shell"), False):
            found.append(f"{path}:{line}: a shell command")
        if owner == "os" and name in ("system", "popen"):
            found.append(f"{path}:{line}: os.{name} (a shell command)")
    return found


def test_the_scanner_finds_what_it_forbids() -> None:
    bad = """
import pickle
from yaml import load
yaml.load(text)
eval("1")
torch.load(path)
np.load(f, allow_pickle=True)
importlib.import_module(name)
AutoModel.from_pretrained(p, trust_remote_code=True)
subprocess.run(cmd, shell=True)
"""
    assert len(violations(bad, "x.py")) == 9
    good = "yaml.safe_load(t)\ntorch.load(p, weights_only=True)\nmodel.eval()\nnp.load(f)\n"
    assert violations(good + "__import__('os')\n", "x.py") == []
    assert violations("importlib.import_module(m)", IMPORTER) == []


def test_no_shipped_code_unpickles_evaluates_or_imports_what_a_config_names() -> None:
    files = [f for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 40
    found = [v for f in files for v in violations(f.read_text(), str(f.relative_to(ROOT)))]
    assert found == []


def test_no_config_key_enables_remote_code() -> None:
    keys = {k: d for k, _, d, _ in reference()}
    assert all(d == "False" for k, d in keys.items() if "trust_remote_code" in k)
    assert FlywheelConfig().security.curve is False  # an option, off by default
