"""Engine backends: the same ``GPUMesh`` API on a Dask or Ray cluster, chosen by URL.

    GPUMesh("http://host:8000")      the native coordinator (gpumesh serve / join)
    GPUMesh("dask://host:8786")      a Dask distributed scheduler (also "tcp://host:8786")
    GPUMesh("ray://host:10001")      a Ray cluster through Ray Client
    GPUMesh("ray://auto")            the Ray cluster this machine belongs to (ray start)

``GPUMesh.__new__`` asks :func:`backend_class` which class serves a URL; a backend is a
subclass of :class:`~gpumesh.client.backends.base.EngineMesh` that implements the small
interface the decorators and the pool API use (``_connect``, ``_submit_all``,
``_engine_workers``, ``_resources``). Engines are imported only when such a URL is used
(extras ``gpumesh[dask]``, ``gpumesh[ray]``).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from ... import limits

#: URL scheme -> "module:Class" of the backend serving it.
SCHEMES = {
    "dask": "gpumesh.client.backends.dask:DaskMesh",
    "tcp": "gpumesh.client.backends.dask:DaskMesh",
    "ray": "gpumesh.client.backends.ray:RayMesh",
}


def scheme_of(url: str | None) -> str:
    """The URL's scheme, lower-cased ('' when there is none)."""
    if not isinstance(url, str) or "://" not in url:
        return ""
    return urlsplit(url.strip()).scheme.lower()


def resolve_url(url: str | None) -> str | None:
    """The URL a ``GPUMesh(url)`` will use: the argument, ``$GPUMESH_URL``, the saved config."""
    if url is None:
        url = limits.setting("GPUMESH_URL")
    if url is None:
        from ... import config
        url = config.load_saved().get("url")
    return url if isinstance(url, str) else None


def backend_class(url: str | None):
    """The backend class for ``url`` (None: the native mesh serves it)."""
    target = SCHEMES.get(scheme_of(resolve_url(url)))
    if target is None:
        return None
    import importlib
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
