"""Jupyter support: ``%load_ext gpumesh`` and the ``%%mesh`` cell magic.

``%%mesh`` runs the cell as usual, then wraps every function the cell defines at its top
level with the default mesh (like ``@mesh``), unless it is already wrapped. Loading the
extension also puts the bare ``mesh`` decorator in the notebook's namespace, unless the
notebook already has a ``mesh`` of its own (which is then left alone).
"""

from __future__ import annotations

import ast


def _top_level_functions(cell: str) -> list[str]:
    try:
        tree = ast.parse(cell)
    except SyntaxError:
        return []
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def load_ipython_extension(ipython) -> None:
    """Called by ``%load_ext gpumesh``."""
    from IPython.core.error import UsageError

    from .client.remote import RemoteFunction, mesh

    def mesh_magic(line: str, cell: str):
        """%%mesh: run this cell, then wrap every function it defines at its top level with
        the default mesh (like @mesh), so calling it or its .map runs on the mesh. Takes no
        options. The mesh comes from $GPUMESH_URL/$GPUMESH_TOKEN or ~/.gpumesh/config.json."""
        if line.strip():
            raise UsageError(f"%%mesh takes no options (got {line.strip()!r})")
        ipython.run_cell(cell)
        ns = ipython.user_ns
        for name in _top_level_functions(cell):
            fn = ns.get(name)
            if callable(fn) and not isinstance(fn, RemoteFunction):
                ns[name] = RemoteFunction(fn, mesh, {})
        # An error inside the cell was already shown by run_cell; raising it again here
        # would print the same traceback twice.
        return None

    ipython.register_magic_function(mesh_magic, magic_kind="cell", magic_name="mesh")
    ipython.user_ns.setdefault("mesh", mesh)
