"""Reading ``.h5ad`` files: a damaged file is an InputError naming it, never an h5py or
anndata traceback.

HDF5 reports damage as whatever its layer meets first: ``OSError`` (bad superblock, a
truncated file, a filter failing on a corrupt chunk), ``RuntimeError`` (a broken group or
heap), ``KeyError`` (an object header that no longer resolves), ``TypeError`` /
``ValueError`` (a datatype or shape that no longer decodes); anndata adds
``IORegistryError`` for an encoding attribute it does not know. The ``try`` blocks hold
only the library calls, so these types mean the file, not this code.
"""

from __future__ import annotations

from ..base.errors import InputError, require_file

HDF5_ERRORS = (OSError, RuntimeError, KeyError, TypeError, ValueError)


def _anndata_errors() -> tuple[type[BaseException], ...]:
    from anndata._io.specs.registry import IORegistryError

    return (*HDF5_ERRORS, IORegistryError)


def damaged(path, e: BaseException, what: str = "cannot read") -> InputError:
    """The InputError for a library error met while reading the damaged file ``path``."""
    detail = str(e).splitlines()[0] if str(e) else ""
    return InputError(f"{what} (damaged file?): {type(e).__name__}: {detail}", path=path)


def read_h5ad(path, what: str = "h5ad file", backed=None):
    """``anndata.read_h5ad(path)``; a missing or damaged file is an InputError naming it.

    A sparse ``X`` (or ``layers["counts"]``) is also checked for consistent ``indptr`` /
    ``indices`` (HDF5 keeps no checksum of uncompressed data).
    """
    import anndata as ad
    import scipy.sparse as sp

    path = require_file(path, what)
    try:
        adata = ad.read_h5ad(path, backed=backed)
    except _anndata_errors() as e:
        raise damaged(path, e, f"cannot read {what}") from None
    if backed is None:
        for name, m in (
            ("X", adata.X),
            *((f"layers/{k}", v) for k, v in adata.layers.items()),
        ):
            if sp.issparse(m):
                try:
                    m.check_format(full_check=True)
                except ValueError as e:
                    raise InputError(f"{name} is not a valid sparse matrix: {e}", path=path) from None
    return adata
