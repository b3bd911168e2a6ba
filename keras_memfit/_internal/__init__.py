"""Private helpers under everything else: Keras's private API, model state, caches, checks, units.

Nothing here imports another keras_memfit layer except the backend seam
(`keras_memfit.backend`), and the backend packages themselves build on the
modules that import nothing of keras_memfit (`keras_compat`, `model_state`,
`units`, `batches`). See ARCHITECTURE.md for the layers.
"""
