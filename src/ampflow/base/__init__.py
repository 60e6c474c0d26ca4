"""The foundation: what every layer of ampflow uses and which imports nothing of ampflow.

* :mod:`.errors`: :class:`~.errors.InputError` (the file, line or key, and the value) and
  checked readers of JSON and required files;
* :mod:`.atomic`: writes that never leave a half-written file under a final name;
* :mod:`.progress`: rate-and-ETA progress lines for long work, and byte counts for people;
* :mod:`.jit`: numba kernels compiled on first use.

``ampflow.contract`` sits directly above it, ``ampflow.io`` above the contract (see
``scripts/import_layers.py`` and the import-linter contract in ``pyproject.toml``).
"""
