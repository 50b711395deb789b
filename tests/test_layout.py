"""The package's layers: imports run downward only, no module imports inside a function unless
a comment beside it gives the measured reason, and no module is over 500 lines."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "eagle_jax"
# bottom to top; a module may import its own layer's modules and any layer below
LAYERS = [("errors", "configs", "paths", "parallel"), ("kernels",), ("model",), ("decoding",), ("training",),
          ("drafters",), ("pipeline",), ("evaluation",), ("cli", "__init__")]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
MAX_LINES = 500


def _modules():
  for path in sorted(ROOT.rglob("*.py")):
    rel = path.relative_to(ROOT).with_suffix("")
    yield path, "eagle_jax." + ".".join(rel.parts).removesuffix(".__init__")


def _layer(module: str) -> int:
  parts = module.split(".")
  return RANK["__init__"] if len(parts) == 1 else RANK[parts[1]]


def _imports(tree: ast.AST, module: str):
  """(imported module, line, inside a function) of every eagle_jax import in ``tree``."""
  funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
  inner = {id(x) for f in funcs for x in ast.walk(f) if x is not f}
  for node in ast.walk(tree):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    for name in names:
      if name.startswith("eagle_jax"):
        yield name, node.lineno, id(node) in inner


def test_every_module_sits_in_a_layer():
  for _, module in _modules():
    assert module == "eagle_jax" or module.split(".")[1] in RANK, f"{module}: in no layer"


def test_imports_run_downward_only():
  wrong = []
  for path, module in _modules():
    for name, line, _ in _imports(ast.parse(path.read_text()), module):
      target = name.split(".")
      if len(target) > 1 and target[1] in RANK and _layer(name) > _layer(module):
        wrong.append(f"{module}:{line} imports {name}")
  assert not wrong, "\n".join(wrong)


def test_no_import_cycle_between_modules():
  known = {m for _, m in _modules()}
  graph = {}
  for path, module in _modules():
    if module == "eagle_jax":
      continue  # the public API re-exports; it is imported by nothing inside
    graph[module] = {n for n, _, _ in _imports(ast.parse(path.read_text()), module)
                     if n in known and n != "eagle_jax"}
  state = {}

  def visit(m, trail):
    if state.get(m) == 1:
      pytest.fail("import cycle: " + " -> ".join(trail[trail.index(m):] + [m]))
    if state.get(m) is None:
      state[m] = 1
      for n in sorted(graph.get(m, ())):
        visit(n, trail + [m])
      state[m] = 2

  for m in sorted(graph):
    visit(m, [])


def test_imports_sit_at_the_top_unless_a_reason_is_given():
  hidden = []
  for path, module in _modules():
    lines = path.read_text().splitlines()
    tree = ast.parse(path.read_text())
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for f in funcs:
      for node in ast.walk(f):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
          text = lines[node.lineno - 1]
          if "import time" not in text.partition("#")[2]:
            hidden.append(f"{module}:{node.lineno}: {text.strip()}")
  assert not hidden, "imports inside functions without a reason beside them:\n" + "\n".join(hidden)


def test_modules_stay_small():
  big = [f"{m}: {len(p.read_text().splitlines())} lines" for p, m in _modules()
         if len(p.read_text().splitlines()) > MAX_LINES]
  assert not big, "\n".join(big)


def test_kernels_import_nothing_above_them():
  for path in (ROOT / "kernels").rglob("*.py"):
    for name, line, _ in _imports(ast.parse(path.read_text()), "eagle_jax.kernels"):
      assert _layer(name) <= RANK["kernels"], f"{path.name}:{line} imports {name}"


def test_a_drafter_kind_is_named_in_few_modules():
  """Kinds are dispatched through the registry, not by comparing names across the package."""
  from eagle_jax.drafters.registry import NAMES

  where = {name: set() for name in NAMES}
  for path, module in _modules():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Constant) and node.value in where:
        where[node.value].add(module)
  assert {n: sorted(m) for n, m in where.items() if len(m) > 3} == {}
  assert where["eagle2"] and where["medusa"]  # the check sees the kinds' own declarations
