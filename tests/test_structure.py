"""The package's shape: no import cycles between torchllama's modules (counting imports inside
functions too, which otherwise hide them), the model code free of checkpoint, device and
training code, and parameter names written in one table per family."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "torchllama"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """torchllama module → the torchllama modules it imports anywhere in its source."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import submodule` needs the submodule; `from pkg import name`, pkg
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                           else node.module for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if target in modules and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}              # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " → ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _imports_of(graph: dict[str, set[str]], prefix: str) -> set[str]:
    """What the modules of package `prefix` (or the module itself) import from outside it."""
    return {dep for module, deps in graph.items()
            if module == prefix or module.startswith(prefix + ".")
            for dep in deps if not (dep == prefix or dep.startswith(prefix + "."))}


def _outside(deps: set[str], allowed: tuple[str, ...]) -> set[str]:
    return {d for d in deps if not any(d == a or d.startswith(a + ".") for a in allowed)}


def test_model_code_imports_only_the_building_blocks():
    # The reader of model.py meets the decoder and nothing else: no kernels, no transforms.
    graph = import_graph()
    base = ("torchllama.config", "torchllama.errors")
    assert _outside(graph["torchllama.model"], base + ("torchllama.nn",)) == set()
    # nn's modules call the kernels' batch-invariant float32 ops (the same math).
    assert _outside(_imports_of(graph, "torchllama.nn"), base + ("torchllama.kernels",)) == set()
    assert _imports_of(graph, "torchllama.kernels") == set()


def test_layers_import_only_downwards():
    """transforms never import generation or serving; generation never imports serving;
    nothing below the CLI imports it; the benches are run by the CLI only (the KV-cache size
    calculator, a pure function of the config, is shared)."""
    graph = import_graph()
    above = {
        "torchllama.transforms": ("torchllama.generation", "torchllama.serving",
                                  "torchllama.bench", "torchllama.train", "torchllama.cli"),
        "torchllama.generation": ("torchllama.serving", "torchllama.bench", "torchllama.train",
                                  "torchllama.cli"),
        "torchllama.serving": ("torchllama.bench", "torchllama.train", "torchllama.cli"),
        "torchllama.tokenizers": ("torchllama.generation", "torchllama.serving",
                                  "torchllama.bench", "torchllama.cli", "torchllama.model"),
        "torchllama.checkpoint": ("torchllama.generation", "torchllama.serving",
                                  "torchllama.bench", "torchllama.cli"),
        # the block types and their modules: below the loaders, the transforms and the model
        "torchllama.blocks": ("torchllama.checkpoint", "torchllama.transforms",
                              "torchllama.model", "torchllama.generation", "torchllama.serving",
                              "torchllama.bench", "torchllama.train", "torchllama.cli"),
    }
    for package, forbidden in above.items():
        deps = _imports_of(graph, package)
        assert _outside(deps, forbidden) == deps, (package, deps - _outside(deps, forbidden))
    users = {m for m, deps in graph.items()
             if any(d.startswith("torchllama.bench") and d != "torchllama.bench.kv_cache_size"
                    for d in deps) and not m.startswith("torchllama.bench")}
    assert users <= {"torchllama.cli", "torchllama"}, users


def test_few_top_level_modules():
    # Packages tell the architecture; at most 8 modules sit at the top beside them.
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 8, modules


def test_gguf_and_hf_tensor_names_only_in_family_tables():
    # Each format's tensor names are written once, in the family adapters.
    for path in PACKAGE.rglob("*.py"):
        if "families" in path.parts:
            continue
        text = path.read_text()
        for name in ("blk.{i}", "attn_q.weight", "self_attn.q_proj", "mlp.gate_proj",
                     "input_layernorm"):
            assert name not in text, (path, name)


#: Functions allowed past MAX_FUNCTION_LINES, each with the reason (none today).
LONG_FUNCTIONS: dict[str, str] = {}
MAX_FUNCTION_LINES = 80


def function_lengths() -> dict[str, int]:
    """'module:function' → its lines, from `def` to its last line (docstring included)."""
    lengths = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths[f"{_module_name(path)}:{node.name}"] = node.end_lineno - node.lineno + 1
    return lengths


def test_no_function_over_80_lines():
    long = {name: n for name, n in function_lengths().items()
            if n > MAX_FUNCTION_LINES and name not in LONG_FUNCTIONS}
    assert long == {}, long


def test_api_modules_translate_into_the_one_request_path():
    """Each API surface is one module of serving/api that imports none of the others (what
    they share lives in api.core, and the JSON schemas of its bodies in api.schemas), and
    only api.core submits to the engine."""
    graph = import_graph()
    shared = {"torchllama.serving.api.core", "torchllama.serving.api.schemas"}
    protocols = {m for m in graph if m.startswith("torchllama.serving.api.")
                 and m not in shared}
    assert {"torchllama.serving.api.chat", "torchllama.serving.api.completions"} <= protocols
    for module in protocols:
        assert graph[module] & protocols == set(), (module, graph[module] & protocols)
        assert "torchllama.serving.engine" not in graph[module], module
