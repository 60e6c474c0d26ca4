"""numba compilation on demand: loading compiled code costs ~0.2-0.3 s per process,
more than small inputs take with numpy/pandas, so hot loops compile only when used."""

from __future__ import annotations


class LazyJit:
    """Wraps a plain-Python loop; :meth:`get` returns it compiled (``nogil``, cached on
    disk), or None when numba is not installed (callers keep a numpy fallback)."""

    def __init__(self, func):
        self.func = func
        self._compiled = None

    @property
    def loaded(self) -> bool:
        return bool(self._compiled)

    def get(self):
        if self._compiled is None:
            try:
                from numba import njit
            except ImportError:  # pragma: no cover - numba comes with scanpy
                self._compiled = False
            else:
                self._compiled = njit(cache=True, nogil=True)(self.func)
        return self._compiled or None
