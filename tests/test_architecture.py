"""The house rules, checked on the source: layered imports without loops, files under 350 lines (tests, benchmarks
and tools too), one trainer."""
import ast
import contextlib
import gc
import os
import re
import traceback
from collections import defaultdict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("tupe_jax", "launch", "configs")

# Lower layers never import higher ones. Within a layer imports are allowed but may not form a loop.
LAYERS = (
    ("tupe_jax.errors", "tupe_jax.files", "tupe_jax.allocator", "tupe_jax.host", "tupe_jax.xla_options",
     "tupe_jax.failed_reads", "tupe_jax.failed_writes", "tupe_jax.local_staging"),
    ("tupe_jax.config", "tupe_jax.positional", "tupe_jax.dropout", "tupe_jax.kernels", "tupe_jax.head", "tupe_jax.projection",
     "tupe_jax.activations", "tupe_jax.attention", "tupe_jax.sharding", "tupe_jax.optim", "tupe_jax.metrics",
     "tupe_jax.plots", "tupe_jax.checkpoint", "tupe_jax.data"),
    ("tupe_jax.model",),
    ("tupe_jax.workdir", "tupe_jax.trainer"),
    ("tupe_jax.pretrain", "tupe_jax.finetune", "tupe_jax.interop"),
    ("tupe_jax.analysis",),
    ("launch", "configs"),
)


def layer_of(module: str) -> int:
    if module == "tupe_jax":
        return 0
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_architecture.py: add it to LAYERS")


def modules() -> dict[str, str]:
    """{dotted module name: path} for every .py file of the packages."""
    out = {}
    for package in PACKAGES:
        for folder, _, names in os.walk(os.path.join(ROOT, package)):
            for name in names:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, ".")
                    out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(folder, name)
    return out


@contextlib.contextmanager
def collector_held():
    """The garbage collector held off, after one collection. In CPython 3.11 a collection that runs inside ast.parse
    can finalise an object left by an earlier test on this worker (an Orbax asyncio task whose failure was never
    retrieved), whose log line formats a traceback, which calls ast.parse again: the nested parse breaks the
    outer one's shared recursion-depth count ("SystemError: AST constructor recursion depth mismatch"). One
    collection first (such finalisers run there, outside any parse), then none until the block ends: a collection
    of a worker's heap takes about a second, so the graph's ~180 parses share one."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def read_ast(path: str) -> ast.Module:
    """The file's AST; call it inside `collector_held()` (or use `parse`)."""
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read())


def parse(path: str) -> ast.Module:
    """`ast.parse` of one file with the collector held off (`collector_held`)."""
    with collector_held():
        return read_ast(path)


def imports(path: str, known: set[str]) -> set[str]:
    """Project modules imported anywhere in the file (module level or inside functions); call it inside
    `collector_held()`."""
    found = set()
    for node in ast.walk(read_ast(path)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        found |= {n for n in names if n.split(".")[0] in PACKAGES}
    return found


@pytest.fixture(scope="module")
def graph():
    known = modules()
    with collector_held():
        return {m: imports(p, set(known)) - {m} for m, p in known.items()}


def test_no_module_imports_a_higher_layer(graph):
    upward = [f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a)]
    assert not upward, upward


def test_no_import_loops(graph):
    state: dict[str, int] = defaultdict(int)   # 0 new, 1 on the stack, 2 done
    loops = []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state[nxt] == 1:
                loops.append(stack[stack.index(nxt):] + [nxt])
            elif state[nxt] == 0:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if state[module] == 0:
            visit(module, [module])
    assert not loops, [" -> ".join(loop) for loop in loops]


def test_files_stay_under_350_lines():
    """The library, the launcher, the tests, the benchmarks and the tools (configs are tables of settings)."""
    paths = [p for m, p in modules().items() if not m.startswith("configs")]
    for folder in ("tests", "benchmarks", "tools"):
        paths += [os.path.join(folder_, name) for folder_, _, names in os.walk(os.path.join(ROOT, folder))
                  for name in names if name.endswith(".py")]
    long = {os.path.relpath(p, ROOT): n for p in paths for n in [sum(1 for _ in open(p, encoding="utf-8"))] if n > 350}
    assert not long, long


def test_the_library_never_imports_the_launcher_or_configs(graph):
    assert not [f"{a} -> {b}" for a, t in graph.items() if a.startswith("tupe_jax") for b in t
                if b.split(".")[0] in ("launch", "configs")]


def test_one_trainer_serves_both_loops(graph):
    """Both loops train through `trainer.Trainer`; neither builds its own jitted step or checkpoint loop."""
    for loop in ("tupe_jax.pretrain.loop", "tupe_jax.finetune.loop"):
        assert "tupe_jax.trainer" in graph[loop], loop
        source = open(modules()[loop], encoding="utf-8").read()
        assert "trainer.fit(" in source and "donate_argnums" not in source and ".save(" not in source, loop


def test_the_checker_sees_an_upward_import(tmp_path):
    """The layer rule is live: a low module importing the launcher would be reported."""
    fake = tmp_path / "m.py"
    fake.write_text("def f():\n    from launch import COMMANDS\n")
    with collector_held():
        found = imports(str(fake), set(modules()))
    assert found == {"launch.COMMANDS"} or found == {"launch"}
    assert layer_of("launch") > layer_of("tupe_jax.optim")


def test_the_source_parses_while_garbage_formats_tracebacks():
    """`parse` holds off the collector: cyclic garbage whose finaliser formats a traceback (3.11's carets call
    ast.parse) is collected outside the parse, so it cannot break it. A plain ast.parse fails here on CPython 3.11.7."""
    def failing():
        table = {}
        return table["a"]["b"] + 1

    class Leftover:                     # a cycle, so only the collector frees it
        def __init__(self):
            self.me = self

        def __del__(self):
            try:
                failing()
            except KeyError as err:
                traceback.format_exception(err)

    path = os.path.join(ROOT, "tupe_jax", "trainer.py")
    for _ in range(3):                  # a plain ast.parse fails at each of them
        garbage = [Leftover() for _ in range(300)]
        del garbage
        assert any(isinstance(node, ast.ClassDef) and node.name == "Trainer" for node in ast.walk(parse(path)))


def test_the_readme_layout_names_every_module():
    """The README's layout section is the map a newcomer reads: every module of tupe_jax/ is named in it."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        block = f.read().split("## Layout", 1)[1].split("```", 2)[1]
    missing = [path for path in sorted(modules().values()) if not path.endswith("__init__.py")
               and os.sep + "tupe_jax" + os.sep in path
               and not re.search(r"\b" + re.escape(os.path.basename(path)[:-3]) + r"\b", block)]
    assert not missing, f"README.md's layout section does not name {missing}"
