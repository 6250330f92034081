"""The import graph of jaxtrain, read from the source: no cycles, and no function-local imports of
jaxtrain's own modules beyond a short list, each with its reason.

The graph has an edge A -> B when module A imports module B at module level (class bodies and
``if``/``try`` blocks included; function bodies and ``if TYPE_CHECKING:`` blocks not, since
they do not run when A is imported). ``from jaxtrain.x import y`` is an edge to
``jaxtrain.x.y`` when that is a module, else to ``jaxtrain.x``. Importing ``jaxtrain.a.b``
from outside ``jaxtrain.a`` first runs ``jaxtrain/a/__init__.py``, so the edge goes to every
package on the way that the importer is not itself inside: a package ``__init__`` that
re-exports its submodules takes part in cycles like any module, which is how such cycles fail
at run time (a partly initialised module, depending on which module was imported first).

A function-local import of a jaxtrain module hides an edge from this graph; the second test
keeps those to the list below, each with the reason it is local.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jaxtrain", "kernels")

# Cycles allowed in the module-level graph, as sorted tuples of the modules in one strongly
# connected component (with why each may stay). None today.
ALLOWED_CYCLES: dict[tuple[str, ...], str] = {}

# Function-local imports of jaxtrain/kernels modules: (importer, imported) -> why it is local.
LAZY = "keeps JAX out of importing this module"
LOCAL_IMPORTS: dict[tuple[str, str], str] = {
    # Pallas (jax.experimental.pallas and its Triton lowering) loads only when a kernel is
    # selected; tests also swap kernels.flash_attention.flash_attention for a spy.
    ("jaxtrain.models.attention", "kernels.flash_attention"): "Pallas: only with the kernel",
    ("jaxtrain.parallel.context", "kernels.flash_attention"): "Pallas: only with the kernel",
    ("jaxtrain.models.config", "kernels.flash_attention"): "Pallas: only with block sizes set",
    ("jaxtrain.ops", "kernels.grouped_gemm"): "Pallas: only with grouped_gemm",
    # Config loading and the dry run's translation stay free of JAX (a test checks that the HF
    # translation does not import it); the MoE layer-frequency parser lives in the models.
    ("jaxtrain.config.rules", "jaxtrain.models.moe"): LAZY + " (config loading)",
    # The pipeline layout language is parsed in parallel.stages, which reads config.errors.
    ("jaxtrain.config.rules", "jaxtrain.parallel.stages"): "parallel.stages imports config",
    # parallel/ is start-up code importable without JAX (flags are computed and written before
    # the backend starts); only ddp_num_buckets's parameter count needs the model package.
    ("jaxtrain.parallel.xla_flags", "jaxtrain.models.config"): LAZY + " (start-up)",
    ("jaxtrain.parallel.xla_flags", "jaxtrain.models.params"): LAZY + " (start-up)",
    # The CLI loads the checkpoint code and the loop only for a training run, after the XLA
    # flags are written and the multi-process job is joined.
    ("jaxtrain.train", "jaxtrain.checkpoint_args"): LAZY + " (CLI start-up)",
    ("jaxtrain.train", "jaxtrain.loop"): LAZY + " (CLI start-up)",
    ("jaxtrain.train", "jaxtrain.distill.run"): LAZY + " (CLI start-up)",
    ("jaxtrain.preflight", "jaxtrain.distill.plan"): LAZY + " (preflight)",
    # The CLI imports preflight at start-up; what preflight checks (and JAX with it) loads
    # only once a config has resolved, so --help and config errors answer without JAX.
    ("jaxtrain.preflight", "jaxtrain.data.sources"): LAZY + " (preflight)",
    ("jaxtrain.preflight", "jaxtrain.evaluation"): LAZY + " (preflight)",
    ("jaxtrain.preflight", "jaxtrain.models"): LAZY + " (preflight)",
    ("jaxtrain.preflight", "jaxtrain.checkpoint"): LAZY + " (preflight)",
    ("jaxtrain.preflight", "jaxtrain.checkpoint.hf_init"): LAZY + " (preflight)",
    ("jaxtrain.preflight", "jaxtrain.dpo"): LAZY + " (preflight)",
    ("jaxtrain.preflight", "jaxtrain.logs"): LAZY + " (preflight)",
    ("jaxtrain.preflight", "jaxtrain.loss_scale"): LAZY + " (preflight)",
    ("jaxtrain.preflight", "jaxtrain.models.config"): LAZY + " (preflight)",
    ("jaxtrain.preflight", "jaxtrain.parallel.stages"): LAZY + " (preflight)",
    ("jaxtrain.preflight", "jaxtrain.observe.trackers"): LAZY + " (preflight)",
    ("jaxtrain.preflight", "jaxtrain.optim.optimizers"): LAZY + " (preflight)",
    ("jaxtrain.preflight", "jaxtrain.optim.schedules"): LAZY + " (preflight)",
    ("jaxtrain.preflight", "jaxtrain.parallel.mesh"): LAZY + " (preflight)",
    ("jaxtrain.preflight", "jaxtrain.parallel.xla_flags"): LAZY + " (preflight)",
    ("jaxtrain.preflight", "jaxtrain.train_config"): LAZY + " (preflight)",
}


class Source:
    """The Python modules of PACKAGES under ``root``, and their imports."""

    def __init__(self, root: pathlib.Path):
        self.modules: dict[str, pathlib.Path] = {}
        for package in PACKAGES:
            for path in (root / package).rglob("*.py"):
                parts = list(path.relative_to(root).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                self.modules[".".join(parts)] = path

    def _owner(self, name: str) -> str | None:
        """The module ``name`` is, or the closest enclosing one (None outside the repo)."""
        while name and name not in self.modules:
            name = name.rpartition(".")[0]
        return name or None

    def targets(self, importer: str, node, packages: bool = True) -> list[str]:
        """The repository modules an import statement in ``importer`` loads (without
        ``packages``: only the ones it names, not the packages they are in)."""
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                here = importer.split(".")
                if self.modules[importer].name != "__init__.py":
                    here = here[:-1]
                here = here[:len(here) - (node.level - 1)]
                base = ".".join(here + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in self.modules else base
                     for a in node.names]
        found = []
        for name in names:
            target = self._owner(name)
            if target is None:
                continue
            # every package on the way in runs first, unless the importer is inside it already
            parts = target.split(".") if packages else [target]
            for i in range(1, len(parts)):
                package = ".".join(parts[:i])
                if not (importer == package or importer.startswith(package + ".")):
                    found.append(package)
            found.append(target)
        return [t for t in found if t != importer]

    def imports(self, name: str):
        """(module-level, function-local) import statements of module ``name``."""
        path = self.modules[name]
        top, local = [], []

        def walk(node, in_function):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                (local if in_function else top).append(node)
                return
            if isinstance(node, ast.If) and ast.unparse(node.test) in (
                    "TYPE_CHECKING", "typing.TYPE_CHECKING"):
                return
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                in_function = True
            for child in ast.iter_child_nodes(node):
                walk(child, in_function)

        walk(ast.parse(path.read_text(), filename=str(path)), False)
        return top, local

    def graph(self) -> dict[str, dict[str, int]]:
        """importer -> {imported: line of the first import}, module-level imports only."""
        out = {}
        for name in self.modules:
            edges: dict[str, int] = {}
            for node in self.imports(name)[0]:
                for target in self.targets(name, node):
                    edges.setdefault(target, node.lineno)
            out[name] = edges
        return out


def cycles(g: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
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
                found.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def _path(g, component: list[str]) -> list[str]:
    """One cycle through ``component``'s first module, found breadth first."""
    members, start = set(component), component[0]
    previous, queue = {start: None}, [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(g[v]):
            if w == start:
                path = [v]
                while previous[path[-1]] is not None:
                    path.append(previous[path[-1]])
                return [*reversed(path), start]
            if w in members and w not in previous:
                previous[w] = v
                queue.append(w)
    return component


def _show(g, cycle: list[str]) -> str:
    steps = [f"{a} (line {g[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
    return "\n    ".join(steps)


def test_the_module_level_import_graph_has_no_cycle():
    g = Source(ROOT).graph()
    found = [c for c in cycles(g) if tuple(c) not in ALLOWED_CYCLES]
    assert not found, "import cycles among jaxtrain modules:\n  " + "\n  ".join(
        "cycle:\n    " + _show(g, _path(g, c)) for c in found)
    stale = [c for c in ALLOWED_CYCLES if list(c) not in cycles(g)]
    assert not stale, f"allowed cycles that no longer exist (remove them): {stale}"


def test_function_local_imports_of_jaxtrain_modules_are_the_listed_ones():
    """A function-local import of a jaxtrain module is either a lazy import on purpose or a
    patched cycle; each one is listed in LOCAL_IMPORTS with its reason."""
    source, seen = Source(ROOT), {}
    for name in source.modules:
        for node in source.imports(name)[1]:
            for target in source.targets(name, node, packages=False):
                seen.setdefault((name, target), node.lineno)
    unlisted = sorted(set(seen) - set(LOCAL_IMPORTS))
    assert not unlisted, ("function-local imports of jaxtrain modules: import them at module "
                          "level (break the cycle by moving the shared piece down), or list "
                          "them in LOCAL_IMPORTS with the reason:\n  " + "\n  ".join(
                              f"{a} (line {seen[a, b]}) -> {b}" for a, b in unlisted))
    stale = sorted(set(LOCAL_IMPORTS) - set(seen))
    assert not stale, f"LOCAL_IMPORTS entries no longer found (remove them): {stale}"


def test_the_graph_sees_a_cycle_through_a_package_init(tmp_path):
    """Package ``__init__`` files are part of the graph: a module that a package's
    ``__init__`` loads, reaching back into that package from outside, closes a cycle."""
    files = {"jaxtrain/__init__.py": "",
             "jaxtrain/a/__init__.py": "from jaxtrain.a.x import f\n",
             "jaxtrain/a/x.py": "from jaxtrain.b import y\nf = 1\n",
             "jaxtrain/a/z.py": "g = 2\n",
             "jaxtrain/b/__init__.py": "",
             "jaxtrain/b/y.py": "from jaxtrain.a.z import g\n",
             "jaxtrain/c.py": "def late():\n    from jaxtrain.a import x\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    source = Source(tmp_path)
    g = source.graph()
    assert g["jaxtrain.b.y"] == {"jaxtrain.a": 1, "jaxtrain.a.z": 1}
    assert cycles(g) == [["jaxtrain.a", "jaxtrain.a.x", "jaxtrain.b.y"]]
    assert g["jaxtrain.c"] == {}
    assert [ast.unparse(n) for n in source.imports("jaxtrain.c")[1]] == [
        "from jaxtrain.a import x"]
