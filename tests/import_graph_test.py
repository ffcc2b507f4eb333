"""The import graph of jlp/ and pallas_kernels/ has no cycles (issue 38, part 6).

Every `import` / `from ... import` statement is read with `ast`, at module level and inside
functions and classes alike (a function-local import that closes a cycle is still a cycle, only
deferred). `from package import name` counts as an import of the submodule `package.name` when
that file exists, else of `package` itself. The graph's edges are between the modules of jlp/
and pallas_kernels/ (standard and third-party imports are ignored); a package's __init__ is the
module named by the package.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jlp", "pallas_kernels")


def _module_files() -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every .py file under PACKAGES."""
  modules = {}
  for package in PACKAGES:
    for path in sorted((ROOT / package).rglob("*.py")):
      parts = list(path.relative_to(ROOT).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts.pop()
      modules[".".join(parts)] = path
  return modules


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
  """The modules of `modules` that the file of module `name` imports, anywhere in it."""
  is_package = path.name == "__init__.py"
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
      else:
        source = node.module
      targets = []
      for alias in node.names:
        sub = f"{source}.{alias.name}"
        targets.append(sub if sub in modules else source)
    else:
      continue
    for target in targets:
      # `import a.b.c` imports a.b.c; keep the longest prefix that is one of ours.
      while target and target not in modules:
        target = target.rpartition(".")[0]
      if target and target != name:
        found.add(target)
  return found


def import_graph() -> dict[str, set[str]]:
  modules = _module_files()
  return {name: _imports(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components with more than one module (Tarjan), each sorted."""
  index, low, on_stack, stack, out = {}, {}, set(), [], []
  counter = [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return sorted(out)


def _path(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
  """A shortest import chain start -> ... -> goal, or None."""
  previous, frontier = {start: None}, [start]
  while frontier:
    nxt = []
    for v in frontier:
      for w in sorted(graph[v]):
        if w not in previous:
          previous[w] = v
          nxt.append(w)
    frontier = nxt
  if goal not in previous:
    return None
  chain = [goal]
  while chain[-1] != start:
    chain.append(previous[chain[-1]])
  return chain[::-1]


# The three knots issue 38 names (part 6). The first two were import cycles, each side importing
# the other (one side's import inside a function); the third is a layering knot: jlp.gemm.qdot
# imported jlp.quantize, the public layer above jlp.gemm. What both sides need now lives below both
# (jlp.gemm.accum_step, jlp.numerics.f32_bits, jlp.numerics.quantize_core).
CYCLE_KNOTS = (
    ("jlp.gemm.accum", "pallas_kernels.accum_matmul"),
    ("jlp.numerics.compat", "jlp.numerics.float_cast"),
)
LAYER_KNOTS = (
    ("jlp.gemm.qdot", "jlp.quantize"),  # (importer below, module above it)
)
# casync <-> powersgd (their shared leaf helpers now in jlp.compression.leaves) and diloco <-> sync
# (GradSync now in jlp.grad_sync, below both) were untied too: no cycle is allowed.
KNOWN_CYCLES = ()


@pytest.fixture(scope="module")
def graph():
  return import_graph()


def test_the_graph_sees_imports(graph):
  # Guards the parser: module-level, function-local and relative imports, and the cycle finder.
  assert "jlp.formats" in graph["jlp.gemm.accum"]
  assert "jlp.numerics.float_cast" in graph["pallas_kernels.float_cast"]
  assert "pallas_kernels.float_cast" in graph["jlp.numerics.quantize_core"]  # inside a function
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("a,b", CYCLE_KNOTS, ids=[f"{a}-{b}" for a, b in CYCLE_KNOTS])
def test_named_cycles_are_untied(graph, a, b):
  there, back = _path(graph, a, b), _path(graph, b, a)
  assert there is None or back is None, (
      f"import cycle: {' -> '.join(there)} and {' -> '.join(back)}")


@pytest.mark.parametrize("low,high", LAYER_KNOTS, ids=[f"{a}-{b}" for a, b in LAYER_KNOTS])
def test_lower_layer_does_not_import_the_one_above(graph, low, high):
  chain = _path(graph, low, high)
  assert chain is None, f"{low} reaches {high}: {' -> '.join(chain)}"


def test_no_other_import_cycles(graph):
  found = [c for c in cycles(graph) if c not in [sorted(k) for k in KNOWN_CYCLES]]
  assert not found, "import cycles between modules:\n" + "\n".join(
      " <-> ".join(component) for component in found)


if __name__ == "__main__":
  for component in cycles(import_graph()):
    print(" <-> ".join(component))
