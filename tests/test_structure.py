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


def test_model_code_imports_no_checkpoint_training_or_serving_code():
    graph = import_graph()
    # The model's own kernels (torchllama.kernels) are model math too, and import nothing else.
    model_code = ["torchllama.model", "torchllama.kernels"] + \
        [m for m in graph if m.startswith("torchllama.nn")]
    for module in model_code:
        for dep in graph[module]:
            assert dep.startswith(("torchllama.nn", "torchllama.config", "torchllama.errors",
                                   "torchllama.kernels")), (module, dep)


def test_gguf_and_hf_tensor_names_only_in_family_tables():
    # Each format's tensor names are written once, in the family adapters.
    for path in PACKAGE.rglob("*.py"):
        if "families" in path.parts:
            continue
        text = path.read_text()
        for name in ("blk.{i}", "attn_q.weight", "self_attn.q_proj", "mlp.gate_proj",
                     "input_layernorm"):
            assert name not in text, (path, name)
