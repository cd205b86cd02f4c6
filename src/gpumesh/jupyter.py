"""Jupyter support: ``%load_ext gpumesh`` and the ``%%mesh`` cell magic.

A cell that starts with ``%%mesh`` runs as an ordinary cell in which every function
defined at its top level is wrapped for the mesh (as if decorated with ``@mesh``) the
moment its ``def`` runs, so the rest of the same cell can already call it or its
``.map``. Loading the extension also puts the bare ``mesh`` decorator in the notebook's
namespace, unless the notebook already has a ``mesh`` of its own, which is left alone (a
``GPUMesh`` named ``mesh`` is the one ``%%mesh`` uses; see :func:`wrap`).

The cell is not run by the magic but by IPython itself, so it stays an ordinary cell:
what it prints and the value of its last line show as usual, a traceback names the
user's own lines (``%%mesh`` is line 1), and an error stops "Run All"::

    raw cell  "%%mesh\\n<body>"
      │ input transformer (runs before IPython's cell-magic one): the "%%mesh" line
      │ becomes a marker string, still on line 1, so every line keeps its number
      ▼
    "'<marker>'\\n<body>"   parsed by IPython as usual (magics in the body work)
      │ AST transformer: a module that starts with the marker loses it, and each
      │ top-level ``def`` gets one more, outermost, decorator: :func:`wrap`; the
      │ cell's text that IPython keeps for tracebacks (linecache) gets "%%mesh" back
      │ as its line 1, so no listing shows the marker
      ▼
    compiled, run and displayed by IPython like any other cell

A worker's traceback names a cell's frames as IPython names its own (``Cell In[2], line
4, in bad``): see :func:`gpumesh.client.calls.with_source`.

``%%mesh`` followed by anything on its line is left to the magic, which refuses it. A
cell handed to the magic directly (``get_ipython().run_cell_magic("mesh", "", src)``)
goes through the same two transformers and runs in the manner of ``%%time``.
"""

from __future__ import annotations

import ast
import linecache
from collections.abc import Callable
from typing import Any

#: What the "%%mesh" line becomes: a string statement no one writes on a cell's line 1.
MARKER = "__gpumesh_mesh_cell__"
_MARKER_LINE = repr(MARKER) + "\n"
#: What tracebacks list as a ``%%mesh`` cell's line 1 (see :func:`show_mesh_line`).
CELL_LINE = "%%mesh\n"


def wrap(own_mesh: Any = None) -> Callable[[Any], Any]:
    """The decorator ``%%mesh`` adds to each top-level ``def``: ``wrap(<the notebook's
    "mesh">)``, applied to what the ``def`` and its own decorators made.

    A plain callable becomes a :class:`~gpumesh.client.remote.RemoteFunction` on the
    notebook's ``mesh`` if that is a :class:`~gpumesh.GPUMesh` (what ``@accelerate(mesh)``
    would use), else on the mesh set with ``accelerate.install()``, else the default mesh
    (``$GPUMESH_URL``/``$GPUMESH_TOKEN`` or ``~/.gpumesh/config.json``). One already
    decorated with ``@mesh``/``@accelerate(...)`` keeps its own mesh and options; anything
    that is not callable is returned unchanged, and so is a generator function (its
    calls could not send a generator back from a worker; ``@mesh`` refuses one), as
    ``async def`` is.
    """
    from .client.mesh import GPUMesh
    from .client.pipeline import unsupported_function
    from .client.remote import RemoteFunction

    target = own_mesh if isinstance(own_mesh, GPUMesh) else None

    def decorate(obj: Any) -> Any:
        if (isinstance(obj, RemoteFunction) or not callable(obj)
                or unsupported_function(obj) is not None):
            return obj
        return RemoteFunction(obj, target, {})
    return decorate


def mark_cell(lines: list[str]) -> list[str]:
    """IPython input transformer: ``%%mesh`` alone on the first line -> the marker line."""
    if lines and lines[0].strip() == "%%mesh":
        return [_MARKER_LINE, *lines[1:]]
    return lines


class WrapFunctions(ast.NodeTransformer):
    """IPython AST transformer: in a marked cell, drop the marker and add :func:`wrap`
    as the outermost decorator of every top-level ``def``. ``async def`` is left as it
    is: a task runs a plain function, so a coroutine function could not run on a worker.
    Other cells pass through unchanged."""

    def visit_Module(self, node: ast.Module) -> ast.Module:
        if not node.body or not _is_marker(node.body[0]):
            return node
        del node.body[0]
        for stmt in node.body:
            if isinstance(stmt, ast.FunctionDef):
                stmt.decorator_list.insert(0, _wrap_expr(stmt))
        show_mesh_line()  # (IPython cached the cell's text before transforming its tree)
        return node


def show_mesh_line() -> None:
    """Give every cached cell text whose line 1 is the marker its ``%%mesh`` line back.

    IPython keeps each cell's transformed text in :mod:`linecache` (with no mtime, so it
    is never dropped) for its tracebacks to list; a ``%%mesh`` cell's would show the
    marker as line 1. Only that line changes: every other line stays IPython's text."""
    for name, entry in list(linecache.cache.items()):
        if len(entry) == 4 and entry[2] and entry[2][0] == _MARKER_LINE:
            size, mtime, lines, fullname = entry
            linecache.cache[name] = (size, mtime, [CELL_LINE, *lines[1:]], fullname)


def _is_marker(stmt: ast.stmt) -> bool:
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
            and stmt.value.value == MARKER)


def _wrap_expr(at: ast.stmt) -> ast.expr:
    # Found through __import__ rather than a name in the notebook's namespace, so a user
    # variable (``wrap``, ``gpumesh``) can never change what it refers to; the notebook's
    # ``mesh`` is read when the def runs, as a decorator naming it would be.
    expr = ast.parse(f"__import__({__name__!r}, fromlist=['wrap']).wrap(globals().get('mesh'))",
                     mode="eval").body
    for sub in ast.walk(expr):  # on the def's own line: a traceback through it names it
        node: Any = sub  # ast.AST declares no positions; each node here takes them
        node.lineno, node.end_lineno = at.lineno, at.lineno
        node.col_offset, node.end_col_offset = at.col_offset, at.col_offset
    return expr


def _run_body(ipython, cell: str) -> Any:
    """Run a cell body given to the magic directly, like ``%%time`` does: the last
    expression's value is returned (IPython shows it); an exception propagates."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    source = ipython.transform_cell(_MARKER_LINE + cell)
    tree = ipython.transform_ast(ipython.compile.ast_parse(source))
    if not any(_ours(t) for t in ipython.ast_transformers):
        tree = WrapFunctions().visit(tree)  # someone took ours out of IPython's list
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    name = ipython.compile.cache(source, ipython.execution_count, raw_code=cell)
    show_mesh_line()
    exec(ipython.compile(tree, name, "exec"), ipython.user_ns)
    return None if last is None else eval(ipython.compile(last, name, "eval"), ipython.user_ns)


def load_ipython_extension(ipython) -> None:
    """Called by ``%load_ext gpumesh`` (again after ``%reload_ext``)."""
    from IPython.core.error import UsageError

    from .client.remote import mesh

    def mesh_magic(line: str, cell: str):
        """%%mesh: run this cell as usual, with every function it defines at its top
        level wrapped for the mesh as its def runs (like @mesh), so calling it or its
        .map, in this cell or later ones, runs on the mesh. Takes no options. The mesh is
        the notebook's `mesh` if that is a GPUMesh, else the one set with
        accelerate.install(), else $GPUMESH_URL/$GPUMESH_TOKEN or ~/.gpumesh/config.json."""
        if line.strip():
            raise UsageError(f"%%mesh takes no options (got {line.strip()!r})")
        return _run_body(ipython, cell)

    unload_ipython_extension(ipython)  # never two copies of the transformers
    ipython.input_transformers_cleanup.append(mark_cell)
    ipython.ast_transformers.append(WrapFunctions())
    ipython.register_magic_function(mesh_magic, magic_kind="cell", magic_name="mesh")
    ipython.user_ns.setdefault("mesh", mesh)


def unload_ipython_extension(ipython) -> None:
    """Called by ``%unload_ext gpumesh``: the magic and the transformers go (``%%mesh``
    is then an unknown magic again); the notebook's ``mesh`` stays, the user may use it."""
    ipython.magics_manager.magics["cell"].pop("mesh", None)
    cleanup = ipython.input_transformers_cleanup
    cleanup[:] = [t for t in cleanup if not _ours(t)]
    ipython.ast_transformers[:] = [t for t in ipython.ast_transformers if not _ours(t)]


def _ours(transformer: Any) -> bool:
    # By name, not identity: after %reload_ext the module's objects are new ones.
    kind = type(transformer) if isinstance(transformer, ast.NodeTransformer) else transformer
    return (getattr(kind, "__module__", None) == __name__
            and getattr(kind, "__qualname__", None) in ("mark_cell", "WrapFunctions"))
